"""Batched, cached access to a model through the DEVELOPERS.md model API, and image loading.

Everything the evaluation asks of a model goes through `Encoder`: `pixel_transform(resize_mode)` (uint8 pixels, which
the model normalises on its device: models/pixels.py), `tokenize`, `encode_image`, `encode_text`, `region_features`
(and `image_size` for box conversion). Embeddings
are cached per resize mode and image (path + crop box) and per text for one run, so benchmarks that share the
val images and the protocol (retrieval, SugarCrepe, ...) encode each image once.

Each benchmark resizes as its official script does (`PROTOCOL_RESIZE`, the one map; the suite hands every
benchmark `encoder.with_resize(PROTOCOL_RESIZE[task])`). On square images both modes give the same tensor.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from PIL import Image

from clipfinetune.boxes import resize_boxes
from clipfinetune.io import read_image
from clipfinetune.models.clip_model import PAD_ID

ImageKey = tuple  # (path: str, crop: tuple[float, float, float, float] | None)

# Resize of each benchmark's official protocol. open_clip's preprocess (short side to the input size, then centre
# crop: "shortest") in the retrieval (CLIP_benchmark, open_clip, GOAL's retrieval_goal.py / mAP script, Long-CLIP),
# zero-shot (open_clip, CLIP_benchmark) and compositionality (SugarCrepe, ARO, VALSE, Winoground) scripts;
# FineCLIP's box classification squash-resizes (`Resize((s, s))`, docs/methods.md §1.3), so boxes map by scaling.
PROTOCOL_RESIZE = {"retrieval": "shortest", "long_retrieval": "shortest", "global_local": "shortest",
                   "box_cls": "squash", "box_cls_hard": "squash", "sugarcrepe": "shortest", "aro": "shortest",
                   "valse": "shortest", "winoground": "shortest", "zeroshot": "shortest"}


def load_image(path: str | os.PathLike, crop=None, record=None) -> Image.Image:
    """RGB PIL image, optionally cropped to an xyxy box in original pixels; clear error if missing."""
    im = read_image(path, record=record)
    if crop is not None:
        im = im.crop(tuple(round(float(v)) for v in crop))
    return im


def text_batches(tokens: torch.Tensor, batch_size: int) -> list[list[int]]:
    """Row indices of `tokens` in batches of similar token counts: the text trunk runs each batch at its longest text
    (exact under the causal mask), so mixed lengths spend most of their work on padding. The one batching rule of the
    encoder and of the sharded plan (eval/sharded.py), which must compute the very same batches."""
    order = torch.argsort((tokens != PAD_ID).sum(1), stable=True).tolist()
    return [order[s:s + batch_size] for s in range(0, len(order), batch_size)]

class Encoder:
    """Normalised embeddings of images, texts and boxes, batched under inference_mode."""

    def __init__(self, model, batch_size: int = 128, resize_mode: str = "squash"):
        self.model, self.batch_size = model, int(batch_size)
        self._by_mode: dict[str, dict] = {}       # resize mode -> image cache, shared by `with_resize` views
        self._texts: dict = {}
        self._regions: dict = {}                  # `regions_key(chunk)` -> features, filled by eval/sharded.py
        self._set_resize(resize_mode)

    def _set_resize(self, resize_mode: str) -> None:
        self.resize_mode = resize_mode
        self.transform = self.model.pixel_transform(resize_mode)
        self._images = self._by_mode.setdefault(resize_mode, {})

    def with_resize(self, resize_mode: str) -> Encoder:
        """A view of this encoder whose images use `resize_mode`; text and image caches are shared."""
        if resize_mode == self.resize_mode:
            return self
        view = copy.copy(self)
        view._set_resize(resize_mode)
        return view

    def _device(self):
        try:
            return next(self.model.parameters()).device
        except (AttributeError, StopIteration):
            return torch.device("cpu")

    @torch.inference_mode()
    def images(self, keys: Sequence[ImageKey]) -> torch.Tensor:
        """keys: (path, crop-or-None) -> [N, D] L2-normalised image embeddings."""
        keys = [(str(p), None if c is None else tuple(float(v) for v in c)) for p, c in keys]
        todo = list(dict.fromkeys(k for k in keys if k not in self._images))
        for s in range(0, len(todo), self.batch_size):
            chunk = todo[s:s + self.batch_size]
            x = torch.stack([self.transform(load_image(p, c)) for p, c in chunk]).to(self._device())
            emb = F.normalize(self.model.encode_image(x, normalize=True).float(), dim=-1).cpu()
            self._images.update(zip(chunk, emb))
        return torch.stack([self._images[k] for k in keys]) if keys else torch.zeros(0, 0)

    @torch.inference_mode()
    def texts(self, texts: Sequence[str]) -> torch.Tensor:
        """[N, D] L2-normalised text embeddings (the model's own tokenizer and context length)."""
        texts = [str(t) for t in texts]
        todo = list(dict.fromkeys(t for t in texts if t not in self._texts))
        if todo:
            tokens = self.model.tokenize(todo)
            for rows in text_batches(tokens, self.batch_size):
                emb = self.model.encode_text(tokens[rows].to(self._device()), normalize=True)
                self._texts.update(zip((todo[i] for i in rows), F.normalize(emb.float(), dim=-1).cpu()))
        return torch.stack([self._texts[t] for t in texts]) if texts else torch.zeros(0, 0)

    @torch.inference_mode()
    def regions(self, images: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor:
        """images: (path, boxes [n, 4] xyxy in ORIGINAL pixels) -> [sum n, D] normalised region features.

        Boxes are mapped to the model's input pixels once, with `clipfinetune.boxes.resize_boxes`: the image is
        always squash-resized here (the model's `transform`, FineCLIP's protocol), whatever `resize_mode` says.
        """
        out = []
        size = self.model.image_size
        for s in range(0, len(images), max(1, self.batch_size)):
            chunk = images[s:s + self.batch_size]
            if self._regions:
                hit = self._regions.get(regions_key(chunk))
                if hit is not None:
                    out.append(hit)
                    continue
            pils = [load_image(p) for p, _ in chunk]
            x = torch.stack([self.with_resize("squash").transform(im) for im in pils]).to(self._device())
            boxes = [resize_boxes(torch.as_tensor(b, dtype=torch.float32).reshape(-1, 4), im.size, size)
                     .to(self._device()) for im, (_, b) in zip(pils, chunk)]
            feats = self.model.region_features(x, boxes)
            out.append(F.normalize(feats.float(), dim=-1).cpu())
        return torch.cat(out) if out else torch.zeros(0, 0)


def regions_key(images) -> str:
    """A chunk of `Encoder.regions`' input ((path, boxes), ...) as a string key."""
    import json

    return json.dumps([[str(p), torch.as_tensor(b, dtype=torch.float32).reshape(-1, 4).tolist()] for p, b in images])


def text_classifier(encoder: Encoder, classnames: Sequence[str], templates: Sequence) -> torch.Tensor:
    """Prompt ensemble [C, D]: per class, mean of normalised template embeddings, renormalised
    (open_clip `build_zero_shot_classifier`, CLIP_benchmark, FineCLIP all compute this).

    A template is a str with `{c}` / `{}` (and optionally `{article}`), or a callable(classname).
    """
    rows = []
    for name in classnames:
        texts = [fill_template(t, name) for t in templates]
        rows.append(F.normalize(encoder.texts(texts).mean(0), dim=-1))
    return torch.stack(rows)


def article(name: str) -> str:
    return "an" if name[:1].lower() in "aeiou" else "a"


def fill_template(template, name: str) -> str:
    if callable(template):
        return template(name)
    return template.replace("{c}", name).replace("{article}", article(name)).replace("{}", name)
