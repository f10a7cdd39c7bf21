"""forge: RL post-training of language models on Monarch, torchtitan and vLLM."""

import os

# Monarch's frame limit, raised for whole state dicts: torchstore sets the same value on import,
# printing a warning, when it is unset.
os.environ.setdefault("HYPERACTOR_CODEC_MAX_FRAME_LENGTH", "910737418240")
