"""Structured outputs in the engine: the per-request grammar matchers and each step's bitmask (`manager.py`), over
two grammar engines behind one interface (`llguidance_backend.py`, `xgrammar_backend.py`; `common.py`)."""
