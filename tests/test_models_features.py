"""ClipModel's global, token, dense and region features against open_clip and hand-written references."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

from clipfinetune.models import load_model
from clipfinetune.models.regions import box_patch_mask, roi_pool

CAPTIONS = ["a red circle", "a small blue square to the left of a large green triangle", "x",
            "two hippopotamuses beside a xylophonist, photographed at dusk."]


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    model = load_model("cft-tiny-vit").eval()
    with torch.no_grad():       # non-trivial biases and norms, so every term of every path is exercised
        for name, param in model.clip.named_parameters():
            if name.endswith("bias") or ".ln_" in name or name.startswith(("ln_", "visual.ln_")):
                param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def images():
    return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def tokens(base):
    return base.tokenize(CAPTIONS)


def test_global_embeddings_equal_open_clip(base, images, tokens):
    with torch.no_grad():
        reference_image = base.clip.encode_image(images, normalize=True)
        reference_text = base.clip.encode_text(tokens, normalize=True)
        torch.testing.assert_close(base.encode_image(images), reference_image)
        torch.testing.assert_close(base.image_features(images)["global_"], reference_image)
        torch.testing.assert_close(base.encode_text(tokens), reference_text, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(base.text_features(tokens)["global_"], reference_text, rtol=1e-5, atol=1e-6)


def test_eot_token_of_projected_text_tokens_is_encode_text(base, tokens):
    with torch.no_grad():
        features = base.text_features(tokens)
        eot = [row.index(base.tokenizer.eot_token_id) for row in tokens.tolist()]
        at_eot = features["tokens"][torch.arange(len(tokens)), eot]
        torch.testing.assert_close(at_eot, base.clip.encode_text(tokens), rtol=1e-5, atol=1e-6)


def test_trimmed_text_encoding_equals_untrimmed(base, tokens):
    with torch.no_grad():
        trimmed, full = base.text_features(tokens, trim=True), base.text_features(tokens, trim=False)
    longest = max(int((row != 0).sum()) for row in tokens)
    assert trimmed["tokens"].shape[1] == longest < base.context_length == full["tokens"].shape[1]
    for key in ("tokens", "hidden", "mask"):
        torch.testing.assert_close(trimmed[key], full[key][:, :longest], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(trimmed["global_"], full["global_"], rtol=1e-5, atol=1e-6)


def test_token_mask_keeps_eot_and_drops_sot_and_padding(base, tokens):
    mask = base.text_features(tokens)["mask"]
    for row, row_mask in zip(tokens.tolist(), mask.tolist()):
        n_real = row.index(base.tokenizer.eot_token_id) + 1
        assert row_mask == [False] + [True] * (n_real - 1) + [False] * (len(row_mask) - n_real)


def test_patches_are_open_clips_tokens_projected(base, images):
    tower = copy.deepcopy(base.clip.visual)
    tower.output_tokens = True
    with torch.no_grad():
        _, open_clip_tokens = tower(images)            # ln_post'd, unprojected, CLS removed
        features = base.image_features(images)
    torch.testing.assert_close(features["patches"], open_clip_tokens @ base.clip.visual.proj)
    torch.testing.assert_close(base.clip.visual.ln_post(features["hidden"]), open_clip_tokens)
    assert features["patches"].shape == (2, base.num_patches, base.embed_dim)


def test_pooling_hidden_states_reproduces_the_global_and_patch_embeddings(base, images, tokens):
    with torch.no_grad():
        text = base.text_features(tokens)
        eot = tokens.argmax(-1)
        torch.testing.assert_close(base.pool_text_hidden(text["hidden"][torch.arange(len(tokens)), eot]),
                                   text["global_"], rtol=1e-5, atol=1e-6)
        image = base.image_features(images)
        torch.testing.assert_close(base.pool_image_hidden(image["hidden"][:, 5]),
                                   F.normalize(image["patches"][:, 5], dim=-1))


def _hand_written_dense(clip, images):
    """MaskCLIP by hand: blocks 0..L-2 as usual, then v-proj -> out-proj -> MLP, ln_post, proj, L2."""
    visual = clip.visual
    width = visual.conv1.out_channels
    x = visual.conv1(images).flatten(2).transpose(1, 2)
    x = torch.cat([visual.class_embedding.expand(len(x), 1, width), x], 1) + visual.positional_embedding
    x = visual.ln_pre(x)
    for block in visual.transformer.resblocks[:-1]:
        x = block(x)
    last = visual.transformer.resblocks[-1]

    def layer_norm(t, ln):
        return F.layer_norm(t, (width,), ln.weight, ln.bias, ln.eps)

    w_v, b_v = last.attn.in_proj_weight[2 * width:], last.attn.in_proj_bias[2 * width:]
    x = x + (layer_norm(x, last.ln_1) @ w_v.T + b_v) @ last.attn.out_proj.weight.T + last.attn.out_proj.bias
    hidden = F.gelu(layer_norm(x, last.ln_2) @ last.mlp.c_fc.weight.T + last.mlp.c_fc.bias)
    x = x + hidden @ last.mlp.c_proj.weight.T + last.mlp.c_proj.bias
    out = F.normalize(layer_norm(x[:, 1:], visual.ln_post) @ visual.proj, dim=-1)
    grid = visual.grid_size
    return out.reshape(len(x), grid[0], grid[1], -1).permute(0, 3, 1, 2)


def test_dense_map_equals_hand_written_attention_free_last_block(base, images):
    with torch.no_grad():
        expected = _hand_written_dense(base.clip, images)
        torch.testing.assert_close(base.dense_features(images), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(base.image_features(images, dense=True)["dense"], expected, rtol=1e-5, atol=1e-5)


def test_roi_align_of_a_one_patch_box_returns_that_patch(base, images):
    patch = base.patch_size
    cells = [(0, 0), (3, 5), (7, 7)]
    boxes = torch.tensor([[c * patch, r * patch, (c + 1) * patch, (r + 1) * patch] for r, c in cells],
                         dtype=torch.float)
    with torch.no_grad():
        dense = base.dense_features(images)
        regions = base.region_features(images, [boxes, boxes[:1]])
    expected = torch.stack([dense[0, :, r, c] for r, c in cells] + [dense[1, :, 0, 0]])
    torch.testing.assert_close(regions, expected)


def test_roi_pool_maps_pixel_boxes_onto_the_grid():
    # channel 0 holds each cell's column, channel 1 its row: RoIAlign of a linear ramp is its value at the
    # box centre, which for aligned=True in index units is centre_pixels / pixels_per_cell - 0.5.
    grid, image = 8, 64
    rows, cols = torch.meshgrid(torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64),
                                indexing="ij")
    ramp = torch.stack([cols, rows])[None].repeat(2, 1, 1, 1)
    boxes = [torch.tensor([[10.0, 12.0, 30.0, 20.0], [20.0, 24.0, 52.0, 50.0]], dtype=torch.float64),
             torch.tensor([[16.0, 16.0, 48.0, 40.0]], dtype=torch.float64)]
    pooled = roi_pool(ramp, boxes, (image, image))
    cell = image / grid
    expected = torch.tensor([[(b[0] + b[2]) / 2 / cell - 0.5, (b[1] + b[3]) / 2 / cell - 0.5]
                             for per_image in boxes for b in per_image.tolist()], dtype=torch.float64)
    torch.testing.assert_close(pooled, expected)


@pytest.mark.parametrize("patch", [8, 16])
def test_box_patch_mask_marks_exactly_the_patches_a_box_overlaps(patch):
    image = 64
    boxes = torch.tensor([[0, 0, 64, 64], [0, 0, 8, 8], [4, 4, 12, 12], [7.5, 30, 40.2, 33], [16, 16, 32, 48],
                          [63, 0, 64, 1]], dtype=torch.float)
    mask = box_patch_mask(boxes, (image, image), (patch, patch))
    grid = image // patch
    for box, row_mask in zip(boxes.tolist(), mask):
        expected = [min(box[2], (c + 1) * patch) > max(box[0], c * patch) and
                    min(box[3], (r + 1) * patch) > max(box[1], r * patch)
                    for r in range(grid) for c in range(grid)]
        assert row_mask.tolist() == expected


def test_box_patch_mask_uses_the_models_own_geometry(base):
    box = torch.tensor([[9.0, 1.0, 17.0, 2.0]])
    mask = base.box_patch_mask(box)
    assert mask.shape == (1, base.num_patches)
    assert torch.nonzero(mask[0]).flatten().tolist() == [1, 2]          # row 0, columns 1 and 2 of 8
    degenerate = base.box_patch_mask(torch.tensor([[20.0, 20.0, 20.0, 20.0]]))
    assert torch.nonzero(degenerate[0]).flatten().tolist() == [2 * 8 + 2]


def test_token_spans_decode_back_to_the_words_they_cover(base):
    text = CAPTIONS[3]
    ids = base.tokenize(text)[0].tolist()
    lengths = []
    for word in re.finditer(r"\w+", text):
        positions = base.token_span(text, word.start(), word.end())
        lengths.append(len(positions))
        assert base.tokenizer.decode([ids[p] for p in positions]).strip() == word.group().lower()
    assert max(lengths) > 1                      # a multi-BPE word is covered by all of its tokens
    start = text.index("hippo")                  # a span cutting a word names the whole word
    assert base.token_span(text, start + 2, start + 5) == base.token_span(text, start, start + len("hippopotamuses"))


def test_token_span_drops_positions_truncated_by_the_context(base):
    text = "word " * 100 + "zebra"
    assert base.token_span(text, len(text) - 5, len(text)) == []
    assert base.token_span(text, 0, 4) == [1]


def test_bf16_precision_runs_in_bf16():
    model = load_model("cft-tiny-vit", precision="bf16")
    with torch.no_grad():
        features = model.image_features(torch.randn(1, 3, 64, 64))
        text = model.text_features(model.tokenize(["a red circle"]))
    assert features["patches"].dtype == torch.bfloat16 and text["tokens"].dtype == torch.bfloat16
