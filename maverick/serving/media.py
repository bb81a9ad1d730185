"""Images in OpenAI chat messages (issue 30): `image_url` content parts to image bytes, and the
prompt's <|image|> placeholders to each image's token layout. Host only (no jax).

Sources: `data:image/<format>;base64,...` URLs always; local files (`file://...` or a plain path)
only under the directory the server was started with (`--allowed_local_media_path`, vLLM's name);
never the network (http(s) is refused: the server makes no outgoing request on a client's behalf).
"""

from __future__ import annotations

import base64
import binascii
import os
import urllib.parse

from maverick.vision import preprocess as vision_pre


class MediaError(ValueError):
  """An image part the server refuses; the message says why and what to send instead."""


def image_bytes(url, allowed_local_media_path: str | None = None) -> bytes:
  """The bytes of one image_url's `url` (see the module docstring)."""
  if not isinstance(url, str) or not url:
    raise MediaError(f"image_url.url must be a non-empty string, got {url!r}")
  scheme = url.split(":", 1)[0].lower() if ":" in url else ""
  if scheme in ("http", "https"):
    raise MediaError("fetching images from the network is not supported; send a data: URL "
                     "(data:image/png;base64,...)")
  if scheme == "data":
    return _data_url(url)
  if scheme == "file":
    path = urllib.parse.unquote(urllib.parse.urlparse(url).path)
  elif "://" in url:
    raise MediaError(f"unsupported image URL scheme {scheme!r}; send a data: URL "
                     "(data:image/png;base64,...)")
  else:
    path = url
  return _local_file(path, allowed_local_media_path)


def _data_url(url: str) -> bytes:
  head, sep, payload = url[len("data:"):].partition(",")
  if not sep:
    raise MediaError("a data: URL needs a ',' before its payload: data:image/png;base64,<data>")
  fields = [f.strip().lower() for f in head.split(";")]
  mime = fields[0] or "text/plain"
  if not mime.startswith("image/"):
    raise MediaError(f"unsupported media type {mime!r}: send an image (image/png, image/jpeg, "
                     "image/webp, image/gif, ...)")
  if "base64" not in fields[1:]:
    raise MediaError("the image data: URL must be base64 encoded: data:image/png;base64,<data>")
  try:
    return base64.b64decode(payload, validate=True)
  except (binascii.Error, ValueError) as e:
    raise MediaError(f"the data: URL's payload is not valid base64: {e}") from None


def _local_file(path: str, root: str | None) -> bytes:
  if root is None:
    raise MediaError("local image paths are not allowed on this server (start it with "
                     "--allowed_local_media_path DIR to allow files under DIR); send a data: URL")
  root = os.path.realpath(root)
  full = os.path.realpath(path if os.path.isabs(path) else os.path.join(root, path))
  if os.path.commonpath([root, full]) != root:
    raise MediaError(f"the image path {path!r} is outside the allowed directory "
                     f"(--allowed_local_media_path {root})")
  try:
    with open(full, "rb") as f:
      return f.read()
  except OSError as e:
    raise MediaError(f"cannot read the image file {path!r}: {e.strerror}") from None


def take_images(messages, allowed_local_media_path: str | None = None):
  """(messages with every image part replaced by a text part holding <|image|>, the images'
  bytes in order). HF's Llama 4 chat template puts <|image|> at an image part's place among the
  text parts of its message. Raises MediaError naming messages[i].content[j]."""
  out, images = [], []
  for i, msg in enumerate(messages):
    content = msg.get("content") if isinstance(msg, dict) else None
    if not isinstance(content, list):
      out.append(msg)
      continue
    parts = []
    for j, part in enumerate(content):
      kind = part.get("type") if isinstance(part, dict) else None
      if kind != "image_url":
        parts.append(part)
        continue
      where = f"messages[{i}].content[{j}]"
      spec = part.get("image_url")
      url = spec.get("url") if isinstance(spec, dict) else spec
      try:
        images.append((where, image_bytes(url, allowed_local_media_path)))
      except MediaError as e:
        raise MediaError(f"{where}: {e}") from None
      parts.append({"type": "text", "text": vision_pre.IMAGE_TOKEN})
    out.append(dict(msg, content=parts))
  return out, images


def decode(images, cfg):
  """PreprocessedImage of each (where, bytes) under the tower's preprocessing `cfg`; a part
  Pillow cannot decode is a MediaError naming it."""
  out = []
  for where, data in images:
    try:
      out.append(vision_pre.preprocess_image(vision_pre.decode_image(data), cfg))
    except (vision_pre.ImageInputError, ValueError) as e:
      raise MediaError(f"{where}: {e}") from None
  return out


def expand(ids, tokenizer, images, cfg) -> list[int]:
  """ids with the i-th <|image|> token replaced by image i's token layout
  (vision.image_prompt_tokens of its tile grid)."""
  image_id = tokenizer.token_to_id(vision_pre.IMAGE_TOKEN)
  at = [k for k, t in enumerate(ids) if t == image_id]
  if image_id is None or len(at) != len(images):
    raise MediaError(f"the rendered chat holds {len(at)} {vision_pre.IMAGE_TOKEN} placeholders "
                     f"for {len(images)} images: put images only in user/assistant messages and "
                     f"no literal {vision_pre.IMAGE_TOKEN} in the text")
  out, prev = [], 0
  for k, im in zip(at, images):
    out += ids[prev:k]
    out += tokenizer.encode(vision_pre.image_prompt_tokens(im.tile_grid, cfg), add_bos=False)
    prev = k + 1
  return out + ids[prev:]
