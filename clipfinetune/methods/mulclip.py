"""MulCLIP: the data and forward glue around `losses.mulclip.MulClipLoss` (no public code; docs/methods.md §5).

Data: a shard record with a long caption and its sentences (sentence 0 = the summary). Example:

    image      [3, S, S]  ctx.transform(image)
    text       [L]        the long caption, ctx.tokenize_long (L = 248)
    sub_text   [S', L]    the first S' = max_sentences sentences (empty text where missing), tokenized at 248
    sub_valid  [S'] bool  sentence i exists
    (global-only runs, lambda_word = lambda_sub = 0: `short` [L], sentence 0 only, instead of sub_text/sub_valid)

Forward (`MulClipModule`): ONE vision forward (`image_features`: CLS embedding + projected patches), one text
forward of the long captions (`text_features`: EOT embedding + token states) and one of the VALID sentences
(`encode_text`). Two text calls, not one: each is trimmed to its own longest sequence (exact under the causal
mask), and sentences (~20 tokens) padded to a long caption's length (~150) would cost ~7x more for the B x S'
sentences. Placeholders of missing sentences are not encoded; their slots stay zero, masked by `sub_valid`.

Decisions the paper leaves open (besides those of the loss module):
- Long-CLIP stretching in `build()` with the first 20 rows frozen (`freeze_kept=True`, Long-CLIP's split; MulCLIP
  builds on Long-CLIP, docs/methods.md §0.1); a model whose context is already 248 is left as it is.
- The built module owns the `MulClipLoss` (`module.new_modules`), so its calibration modules and contrast heads are
  parameters of the module the trainer optimises, DDP wraps and checkpoints; `loss()` returns that same instance
  (call it after `build()`, as the trainer does), so they are optimised exactly once. `param_groups` puts them in
  the `new_modules` group at `new_module_lr` (the trainer's decay rule leaves the heads' scale/bias and the
  calibrations' log-temperature without weight decay).
- The model's own `logit_scale` is unused by the sigmoid loss (§3.2: every L_contrast is sigmoid, with its own
  learnable scale and bias; docs/methods.md §5). Trained alone, MulCLIP freezes it (`requires_grad=False`) so it neither
  drifts under weight decay nor leaves DDP waiting for its gradient. In a `custom` mix it is NOT MulCLIP's to
  freeze: it is the learnable temperature of the other methods' softmax terms (GOAL's L_global and local
  contrast train it, docs/methods.md §3.2, no clamp), so each term keeps its own paper's temperature and `custom`
  freezes it only if no method uses it (`unused_model_parameters` here).
  New modules a run never uses are frozen as well (global-only: both calibrations and the word/sub heads;
  lambda_word = 0: the text calibration and the word head; lambda_sub = 0: the sub head; in a mix naming
  neither `contrastive` nor `contrastive_short`: the global head, whose terms are computed but not summed).
- The text states are computed up to the batch's longest text (exact under the causal mask) and zero-padded to
  248 for the text calibration, which masks padding out of its softmax: identical to encoding all 248 positions.
- The summary (`contrastive_short`) is sub-caption 0, always present (records without sentences are skipped).
- Sentences beyond `max_sentences` are cut here (the `sentences` stage already keeps at most that many and counts
  the rest), so the loss's `n_subcaptions_dropped` stays 0; its `max_subcaptions` is set to `max_sentences`.
"""
from __future__ import annotations

import random
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .base import MAX_LOGIT_SCALE, Method


class MulClipModule(nn.Module):
    """The model + MulCLIP's new modules; forward(batch) -> the features dict of `MulClipLoss`."""

    def __init__(self, model, new_modules: nn.Module, tokens: bool = True):
        super().__init__()
        self.model, self.new_modules, self.tokens = model, new_modules, tokens

    def forward(self, batch: dict) -> dict:
        model = self.model
        long_text = batch["text"]
        if not self.tokens:                                       # global-only: CLS/EOT embeddings only
            return {"image": model.encode_image(batch["image"], normalize=True),
                    "text": model.encode_text(long_text, normalize=True),
                    "text_short": model.encode_text(batch["short"], normalize=True)}
        image = model.image_features(batch["image"])
        sub_tokens, sub_valid = batch["sub_text"], batch["sub_valid"].bool()
        text = model.text_features(long_text)
        # eq. (9) queries the patches with the raw sentence embeddings t_sub,i (every contrast normalises its own
        # inputs, so only the attention sees the norm); trimmed to the longest SENTENCE
        rows = sub_valid.flatten().nonzero().squeeze(1)      # sync: as many rows to encode as valid sentences
        encoded = model.encode_text(sub_tokens.flatten(0, 1)[rows], normalize=False)
        sub = encoded.new_zeros(sub_valid.numel(), encoded.shape[1]).index_copy(0, rows, encoded)
        sub = sub.view(*sub_valid.shape, -1)
        pad = model.context_length - text["tokens"].shape[1]      # trimmed -> the calibration's 248 slots
        return {"image": image["global_"], "patches": image["patches"], "text": text["global_"],
                "text_tokens": F.pad(text["tokens"], (0, 0, 0, pad)),
                "text_mask": F.pad(text["mask"], (0, pad), value=False),
                "sub_text": sub, "sub_valid": sub_valid}


class MulClipMethod(Method):
    name = "mulclip"
    caption_kind = "long"
    terms: ClassVar[dict[str, str | None]] = {
        "contrastive": None, "contrastive_short": "lambda_short", "word_patch": "lambda_word",
        "subcaption_patch": "lambda_sub"}
    epoch_unit = "image"            # one long (DOCCI) caption per image: an epoch is one pass over the images
    train_keys = frozenset({"new_module_lr"})
    GLOBAL_TERMS = frozenset({"contrastive", "contrastive_short"})

    def __init__(self, lambda_short: float = 0.5, lambda_word: float = 1.0, lambda_sub: float = 1.0,
                 token_ratio: float = 0.5, max_sentences: int = 15, new_module_lr: float | None = None):
        self.lambda_short, self.lambda_word = float(lambda_short), float(lambda_word)
        self.lambda_sub, self.token_ratio = float(lambda_sub), float(token_ratio)
        self.max_sentences = int(max_sentences)
        self.new_module_lr = None if new_module_lr is None else float(new_module_lr)
        if self.max_sentences < 1:
            raise ValueError(f"max_sentences must be >= 1 (sentence 0 is the summary), got {max_sentences}")
        self.tokens = self.lambda_word != 0 or self.lambda_sub != 0
        self._loss, self._mix_terms = None, None

    def join_mix(self, terms: frozenset[str]) -> None:
        self._mix_terms = frozenset(terms)

    def prepared_tables(self) -> list[tuple[str, str]]:
        return [("sentences", "sentences")]

    def wants(self, record: dict) -> bool:
        return bool(record.get("long_caption")) and bool(record.get("sentences"))

    def make_example(self, record: dict, image, rng: random.Random, ctx) -> dict:
        sentences = [s["text"] for s in record["sentences"][:self.max_sentences]]
        example = {"image": ctx.transform(image), "text": ctx.tokenize_long([record["long_caption"]])[0]}
        if not self.tokens:
            return dict(example, short=ctx.tokenize_long(sentences[:1])[0])
        missing = self.max_sentences - len(sentences)
        return dict(example, sub_text=ctx.tokenize_long(sentences + [""] * missing),
                    sub_valid=torch.arange(self.max_sentences) < len(sentences))

    def build(self, model) -> nn.Module:
        from clipfinetune.losses.mulclip import MulClipLoss
        from clipfinetune.models import stretch_to_long

        stretch_to_long(model, freeze_kept=True)                   # Long-CLIP: rows 0..19 frozen
        if self._mix_terms is None:                                # alone: the sigmoid heads carry the scales
            for p in self.unused_model_parameters(model):          # (in a mix: `custom` decides, see above)
                p.requires_grad_(False)
        loss = MulClipLoss(model.embed_dim, model.num_patches, model.context_length, token_ratio=self.token_ratio,
                           lambda_short=self.lambda_short, lambda_word=self.lambda_word, lambda_sub=self.lambda_sub,
                           max_subcaptions=self.max_sentences)
        unused = [] if self.lambda_word else [loss.text_calibration, loss.heads["word"]]
        unused += [] if self.lambda_sub else [loss.heads["sub"]]
        unused += [] if self.tokens else [loss.patch_calibration]
        unused += [] if self._mix_terms is None or self._mix_terms & self.GLOBAL_TERMS else [loss.heads["global"]]
        for module in unused:
            module.requires_grad_(False)
        self._loss = loss
        return MulClipModule(model, loss, tokens=self.tokens)

    def loss(self) -> nn.Module:
        if self._loss is None:
            raise RuntimeError("MulClipMethod.loss() needs build() first: the loss owns modules of the built module")
        return self._loss

    def unused_model_parameters(self, model) -> list[nn.Parameter]:
        return [model.clip.logit_scale]                            # each objective has its own ContrastHead

    def clamp(self, module: nn.Module) -> None:
        for head in module.new_modules.heads.values():   # its own scales, as open_clip clamps SigLIP's (the model's
            if head.logit_scale.requires_grad:          # scale is not MulCLIP's: frozen alone, in a mix the others')
                head.logit_scale.clamp_(0, MAX_LOGIT_SCALE)

    def param_groups(self, module: nn.Module) -> list[dict]:
        if self.new_module_lr is None:
            return []
        params = [p for p in module.new_modules.parameters() if p.requires_grad]
        return [{"name": "new_modules", "params": params, "lr": self.new_module_lr}]
