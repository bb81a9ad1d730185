"""Llama 4 vision: image preprocessing (here) and the vision tower (maverick.vision.model)."""

from maverick.vision.preprocess import (
  IMAGE_TOKEN,
  PATCH_TOKEN,
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
  "IMAGE_TOKEN",
  "PATCH_TOKEN",
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
