"""Custom kernels for flsmem."""

from flsmem.kernels.topk import topk_mask, topk_mask_reference

__all__ = ["topk_mask", "topk_mask_reference"]
