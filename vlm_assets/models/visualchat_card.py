"""What the Model Registry says about VisualChat. Its own module, with no imports, because
``registered_visualchat`` reads it on every run, cache hits included."""

DESCRIPTION = (
    "VisualChat: a vision encoder joined to a causal-LM decoder through a learned projection, LoRA merged into "
    "the decoder (DeepSpeed-VisualChat's recipe). Input: a DataFrame with `question` (text) and `images` (a list "
    "of PNGs, base64), one conversation turn per row. Output: the greedy answer (`answer`). The model directory "
    "is the `model` artifact: `python -m vlm_assets.chat models:/<name>@<alias>` chats with it in a terminal."
)
