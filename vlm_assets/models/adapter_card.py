"""What the Model Registry says about the occlusion adapter. Its own module, with no imports, because
``registered_adapter`` reads it on every run, cache hits included, and ``adapter_pyfunc`` imports torch."""

DESCRIPTION = (
    "Occlusion adapter in front of a frozen Qwen2.5-VL. Input: a DataFrame with `image` (a PNG, base64) and "
    "`box` ([x0, y0, x1, y1] in that image's pixels: the occluded rectangle). The image is resized to the "
    "training size, the box blacked out and its mask built exactly as in training; the adapter restores the "
    "pixels and the backbone answers greedily. Output: one class name per row (`label`)."
)
