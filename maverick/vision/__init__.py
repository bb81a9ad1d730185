"""Llama 4 vision: image preprocessing (the vision tower itself is not here yet; issue 30)."""

from maverick.vision.preprocess import (
  ImageInputError,
  PreprocessedImage,
  VisionPreprocessConfig,
  best_fit,
  decode_image,
  expand_image_placeholders,
  image_prompt_tokens,
  preprocess_image,
  preprocess_images,
  resize_bilinear_uint8,
  supported_resolutions,
  to_rgb_uint8,
)

__all__ = [
  "ImageInputError",
  "PreprocessedImage",
  "VisionPreprocessConfig",
  "best_fit",
  "decode_image",
  "expand_image_placeholders",
  "image_prompt_tokens",
  "preprocess_image",
  "preprocess_images",
  "resize_bilinear_uint8",
  "supported_resolutions",
  "to_rgb_uint8",
]
