"""Qwen2.5-VL's vision tower and multimodal RoPE positions against transformers' own model (the reference).

A tiny random `Qwen2_5_VLForConditionalGeneration` built by transformers; images through transformers' PIL image
processor. The image sizes give merged grids of several windows with smaller edge windows, so a wrong window
permutation, rotary section or attention segment changes the features.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchllm.model.mrope import mrope_positions
from batchllm.model.qwen2_5_vl_config import VisionTowerConfig
from batchllm.model.qwen2_5_vl_vision import Qwen2_5_VisionTower, _group_segments, image_token_count

transformers = pytest.importorskip("transformers")
PIL_Image = pytest.importorskip("PIL.Image")

IMAGE_TOKEN = 500
MERGE = 2


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=76, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1, 3], window_size=56, patch_size=14, spatial_merge_size=MERGE,
                           temporal_patch_size=2),
        image_token_id=IMAGE_TOKEN, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms start at ones and biases at zeros: perturb all so that every tensor matters
        for param in model.model.visual.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def _processed(sizes: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # Each image's pixels depend only on its size, so one image is the same alone or next to another.
    images = [PIL_Image.fromarray(np.random.default_rng(w * 1000 + h).integers(0, 256, (h, w, 3), dtype=np.uint8))
              for w, h in sizes]
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=256 * 256)
    return processor(images=images, return_tensors="pt")


def _our_tower(hf_model) -> Qwen2_5_VisionTower:
    tower = Qwen2_5_VisionTower(hf_model.config.vision_config.to_dict(), torch.float32)
    prefix = "model.visual."
    tower.load_state_dict({k[len(prefix):]: v for k, v in hf_model.state_dict().items() if k.startswith(prefix)})
    # The MLP's 76 is zero-padded to 128 (aligned GEMMs); the comparisons with HF below show the padding is inert.
    assert tower.blocks[0].mlp.down_proj.in_features == 128
    return tower.eval()


def _hf_features(hf_model, inputs) -> torch.Tensor:
    out = hf_model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    return torch.cat(out.pooler_output)  # transformers 5: an output object, one tensor per image


@pytest.mark.parametrize("sizes", [[(100, 80)], [(100, 80), (140, 196)], [(112, 112), (112, 112)]],
                         ids=["one_image", "two_sizes", "same_size_full_windows"])
def test_tower_matches_transformers(hf_model, sizes):
    inputs = _processed(sizes)
    grids = inputs["image_grid_thw"]
    window_cells = 56 // 14 // MERGE
    assert all(h // MERGE > window_cells and w // MERGE > window_cells for _, h, w in grids.tolist())
    with torch.no_grad():
        ours = _our_tower(hf_model)(inputs["pixel_values"], grids)
        expected = _hf_features(hf_model, inputs)
    assert ours.shape == expected.shape == (sum(image_token_count(g, MERGE) for g in grids), 64)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_segments_of_one_length_that_follow_each_other_are_one_slice():
    """Windows of images of one size are consecutive runs: attention reads them as views (no gather / scatter)."""
    assert _group_segments([64, 64, 32, 32, 16], torch.device("cpu")) == [
        (16, slice(192, 208)), (32, slice(128, 192)), (64, slice(0, 128))]
    (short, index_32), (long, index_64) = _group_segments([64, 32, 64, 32], torch.device("cpu"))
    assert (short, long) == (32, 64)
    assert index_32.tolist() == [list(range(64, 96)), list(range(160, 192))]
    assert index_64.tolist() == [list(range(0, 64)), list(range(96, 160))]


def test_images_do_not_attend_across(hf_model):
    """Each image's features are the same alone as next to another image."""
    both = _processed([(100, 80), (140, 196)])
    alone = _processed([(140, 196)])
    tower = _our_tower(hf_model)
    with torch.no_grad():
        pair = tower(both["pixel_values"], both["image_grid_thw"])
        single = tower(alone["pixel_values"], alone["image_grid_thw"])
    torch.testing.assert_close(pair[-single.shape[0]:], single, atol=1e-5, rtol=1e-5)


def test_tower_config_errors():
    with pytest.raises(ValueError, match="lacks depth"):
        VisionTowerConfig.from_hf({"hidden_size": 32})
    config = VisionTowerConfig.from_hf({"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                        "out_hidden_size": 64, "in_chans": 1})
    assert config.in_channels == 1 and config.fullatt_block_indexes == (7, 15, 23, 31)
    tower = Qwen2_5_VisionTower(config)
    with pytest.raises(ValueError, match="grid_thw describes 8"):
        tower(torch.zeros(4, 1 * 2 * 14 * 14), torch.tensor([[1, 2, 4]]))


def _prompt(grids: list[tuple[int, int, int]]) -> list[int]:
    """Text, image run, text, image run, text; the vision start/end tokens around each run, as the chat template."""
    ids = [1, 2, 3]
    for i, grid in enumerate(grids):
        ids += [502] + [IMAGE_TOKEN] * image_token_count(grid, MERGE) + [503] + [10 + i] * (4 + i)
    return ids


def test_mrope_positions_match_transformers(hf_model):
    grids = [tuple(g) for g in _processed([(100, 80), (140, 196)])["image_grid_thw"].tolist()]
    ids = _prompt(grids)
    positions, delta = mrope_positions(ids, grids, IMAGE_TOKEN, MERGE)
    input_ids = torch.tensor([ids])
    expected, expected_delta = hf_model.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == IMAGE_TOKEN).int(), image_grid_thw=torch.tensor(grids),
        attention_mask=torch.ones_like(input_ids))
    assert positions.dtype == np.int64 and positions.shape == (3, len(ids))
    np.testing.assert_array_equal(positions, expected[:, 0].numpy())
    assert delta == int(expected_delta) and delta < 0  # the images' 2-D extents save positions


def test_mrope_text_only_and_errors():
    positions, delta = mrope_positions([5, 6, 7], [], IMAGE_TOKEN, MERGE)
    np.testing.assert_array_equal(positions, np.tile(np.arange(3), (3, 1)))
    assert delta == 0
    with pytest.raises(ValueError, match="1 runs of image token"):
        mrope_positions([1, IMAGE_TOKEN, 2], [], IMAGE_TOKEN, MERGE)
    with pytest.raises(ValueError, match="needs t\\*h\\*w"):
        mrope_positions([1, IMAGE_TOKEN, IMAGE_TOKEN, 2], [(1, 4, 4)], IMAGE_TOKEN, MERGE)
