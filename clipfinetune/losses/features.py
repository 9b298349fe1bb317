"""The features -> loss contract, written once: the names a method's features module returns and a loss reads.

Every loss `forward(features)` takes a dict whose keys come from FEATURES (tests/test_registry.py checks each
loss's keys against it); a loss's docstring lists which of them it reads and their shapes in its method. B = local
batch, D = joint embedding dim, P = patches, L = text positions, K = negatives per caption, S = sentences.
Embeddings are L2-normalised unless a name says "states"; `*_valid` masks mark placeholder rows (any finite value).
"""
from __future__ import annotations

FEATURES: dict[str, str] = {
    # global embeddings
    "image": "[B, D] the image's global embedding (image_features()['global_'])",
    "text": "[B, D] the positive caption's global embedding (the long caption for GOAL/MulCLIP)",
    "logit_scale": "[] exp(learnable log-temperature) = 1/tau",
    "text_short": "[B, D] the summary caption's embedding (MulCLIP)",
    # hard negatives
    "neg_text": "[B, K, D] negative captions' embeddings",
    "neg_valid": "[B, K] bool, negative k of sample i exists",
    # dense states
    "patches": "[B, P, D] projected patch states after ln_post, not normalised",
    "text_tokens": "[B, (1+K,) L, D] projected text token states, not normalised ([:, 0] = positive if stacked)",
    "text_mask": "[B, (1+K,) L] bool, keeps EOT, drops SOT and padding (text_features()['mask'])",
    "word_mask": "[B, L] bool, the BPE tokens of the matched word (HarmoCLIP)",
    # regions and local pairs
    "region": "[B, D] RoIAlign'd dense feature of a box (model.region_features)",
    "region_text": "[K, D] embedding of each pretraining object's name (stage pretrain, sample/pretrain/loss.py)",
    "region_class": "[K] long, id of that name (equal ids: the same name)",
    "region_teacher": "[B, D] the frozen teacher's embedding of the box crop (HarmoCLIP)",
    "category": "[B] long, the word's category id (HarmoCLIP)",
    "pair_valid": "[B] bool, the sample has a word-region pair (HarmoCLIP)",
    "local_image": "[B, D] embedding of the LISM crop (GOAL)",
    "local_text": "[B, D] embedding of the matched sentence (GOAL)",
    "local_valid": "[B] bool, the image has a local pair (GOAL)",
    "region_pooled": "[B, D] box patches of the global image, mean-pooled, norm + projection (GOAL)",
    "sentence_pooled": "[B, D] the sentence's tokens inside the long caption, same recipe (GOAL)",
    "span_valid": "[B] bool, the sentence's span survived truncation (GOAL)",
    "sub_text": "[B, S, D] sub-caption (sentence) embeddings (MulCLIP)",
    "sub_valid": "[B, S] bool, sentence s exists (MulCLIP)",
    # teachers
    "teacher_image": "[B, D] EMA teacher image embedding (DeGLA)",
    "teacher_text": "[B, D] EMA teacher positive-caption embedding (DeGLA)",
    "teacher_neg_text": "[B, K, D] EMA teacher negative-caption embeddings (DeGLA)",
}
