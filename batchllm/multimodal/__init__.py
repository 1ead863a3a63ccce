"""Images in: decoding media, chat content parts, and what the engine carries for each image."""
