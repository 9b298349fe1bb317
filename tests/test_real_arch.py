"""Real CLIP architectures (issue 25): ViT-B-16 (224 px, 14 x 14 patches, widths 768/512, embed 512), ViT-B-32 and
ViT-L-14-336 at open_clip's own geometry, with 1-2 blocks per tower and random weights (tests/fixtures/real_arch.py):
every method's train step, the export read back by plain open_clip, the dense (MaskCLIP) and RoIAlign region
features against an independent re-computation from open_clip's modules, the box -> feature-map mapping on a
non-square original and a non-square model input, and LISM scoring at 336 px.

The tiny config (embed = vision width = text width = 128, 64 px) cannot show a missing projection, a transposed grid
or a hard-coded size; these widths and grids can."""
from __future__ import annotations

import copy
import random

import open_clip
import pytest
import torch
import torch.nn.functional as F
from fixtures.methods import FixedNegatives, example_context, random_image, shard_record
from fixtures.methods import coco_record as mixed_coco_record
from fixtures.real_arch import shallow_config, shallow_model, shallow_timm_model
from PIL import Image
from torch.utils.data import default_collate

from clipfinetune.data.prepare.lism import match_image
from clipfinetune.eval.encode import Encoder
from clipfinetune.methods import get_method
from clipfinetune.models import export_model
from clipfinetune.train import TrainConfig, Trainer

# name -> (input size, patch size, grid side, vision width, text width, embed dim): open_clip's configs
GEOMETRY = {"ViT-B-16": (224, 16, 14, 768, 512, 512), "ViT-B-32": (224, 32, 7, 768, 512, 512),
            "ViT-L-14-336": (336, 14, 24, 1024, 768, 768)}
W, H = 400, 200                        # a non-square original: the squash resize scales x and y apart


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("real_arch_configs")


@pytest.fixture(scope="module")
def b16(cfg_dir):
    return shallow_model(cfg_dir, "ViT-B-16")


@pytest.fixture(scope="module")
def b32(cfg_dir):
    return shallow_model(cfg_dir, "ViT-B-32")


@pytest.fixture(scope="module")
def b16_wide(cfg_dir):
    """ViT-B-16 with a non-square input, 160 high x 224 wide (open_clip's (H, W)): a 10 x 14 grid."""
    return shallow_model(cfg_dir, "ViT-B-16", suffix="h160w224", vision={"image_size": [160, 224]})


# ------------------------------------------------------------------------------------------------ geometry
@pytest.mark.parametrize("name,fixture", [("ViT-B-16", "b16"), ("ViT-B-32", "b32")])
def test_shallow_models_keep_the_real_geometry(name, fixture, request):
    model = request.getfixturevalue(fixture)
    size, patch, side, vision_width, text_width, embed = GEOMETRY[name]
    assert (model.image_size, model.patch_size, model.grid) == (size, patch, (side, side))
    assert (model.clip.visual.conv1.out_channels == vision_width
            and model.clip.token_embedding.embedding_dim == text_width)
    assert model.embed_dim == embed and model.context_length == 77
    with torch.device("meta"):                                    # the full-depth model: layout only
        full = open_clip.create_model(name, device="meta")
    shallow = dict(model.clip.named_parameters())
    for key, p in full.named_parameters():
        if ".resblocks." not in key:
            assert shallow[key].shape == p.shape, key
    assert len(model.clip.visual.transformer.resblocks) == 2 and len(model.clip.transformer.resblocks) == 1


# ------------------------------------------------------------------------------------------------ methods
CAPTION = ("A picture of two shapes on a grey background. There is a small red circle in the top right corner. "
           "A big blue square sits at the bottom left.")


def coco_record(i):
    return mixed_coco_record(i, W, H, box=(300, 0, 400, 100))                # a top-right word region


def docci_record(i):
    starts = [0, CAPTION.index("There"), CAPTION.index("A big")]
    ends = [CAPTION.index(".") + 1, CAPTION.index("corner.") + 7, len(CAPTION)]
    return shard_record(f"train_{i:05d}", "docci", W, H, long_caption=CAPTION,
                        sentences=[{"text": CAPTION[s:e], "char_span": [s, e]} for s, e in zip(starts, ends)],
                        local_pair=[{"sentence_index": 1, "box": [300, 0, 400, 100]}])


def rule_negatives(caption):
    return {"negclip": " ".join(caption.split()[::-1]), "replace": caption.replace("red", "blue"), "shuffle": None}


RUNS = {   # run -> (method, config, records)
    "clip": ("clip", {}, coco_record),
    "harmoclip": ("harmoclip", {}, coco_record),
    "fsc_clip": ("fsc_clip", {}, coco_record),
    "fsc_clip_lora": ("fsc_clip", {"lora_rank": 4}, coco_record),
    "degla": ("degla", {}, coco_record),
    "goal": ("goal", {}, docci_record),
    "mulclip": ("mulclip", {"max_sentences": 4}, docci_record),
    "custom_coco": ("custom", {"terms": {"fsc_clip.local_hn": 0.5, "degla.distill": 0.005,
                                         "harmoclip.global_region": 1.0}}, coco_record),
    "custom_docci": ("custom", {"terms": {"clip.contrastive": 0, "goal.contrastive": 1.0,
                                          "goal.local_contrastive": 0.5, "mulclip.word_patch": 1.0}}, docci_record),
}


class OneBatch:
    def epoch_length(self, epoch):
        return 1


def train_one_step(base, run):
    name, config, record = RUNS[run]
    model = copy.deepcopy(base)
    method = FixedNegatives(rule_negatives).on(get_method(name)(**config))
    trainer = Trainer(method, model, OneBatch(), TrainConfig(epochs=1, batch_size=2, lr=1e-4))
    ctx = example_context(model)                                # built after `build`, as the train stage's loader
    rng = random.Random(0)
    batch = default_collate([method.make_example(record(i), random_image(i, W, H), rng, ctx) for i in range(2)])
    before = [p.detach().clone() for p in trainer.params]
    scalars = trainer.train_step([batch])                       # the step leaves its gradients in place
    missing = [n for n, p in trainer.module.named_parameters() if p.requires_grad and p.grad is None]
    return method, trainer, model, scalars, before, missing


@pytest.mark.parametrize("run", list(RUNS))
def test_every_method_trains_and_exports_at_vit_b16(b16, run, tmp_path):
    method, trainer, model, scalars, before, missing = train_one_step(b16, run)
    assert all(torch.isfinite(v) for k, v in scalars.items() if k.startswith("loss"))
    assert missing == []                                      # nothing trainable left without a gradient (DDP)
    moved = [not torch.equal(b, p) for b, p in zip(before, trainer.params)]
    # every tensor with a gradient moved (zero-initialised LoRA B leaves its A a zero gradient at step 1)
    assert all(m or not p.grad.any() for m, p in zip(moved, trainer.params)) and sum(moved) > len(moved) / 2
    assert_export_matches_plain_open_clip(method.final_model(trainer.module, model), tmp_path / "export")


@pytest.mark.parametrize("run", ["clip", "goal", "custom_coco", "degla"])
def test_methods_train_at_vit_b32(b32, run):
    _, _, _, scalars, _, missing = train_one_step(b32, run)
    assert missing == [] and all(torch.isfinite(v) for k, v in scalars.items() if k.startswith("loss"))


def assert_export_matches_plain_open_clip(model, folder):
    """`export_model` -> open_clip.create_model_and_transforms('local-dir:...'): same preprocessing, tokens and
    embeddings as the model that was exported (LoRA merged, stretched positions folded)."""
    export_model(model, folder)
    clip, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    clip.eval()
    model.eval()
    pil = random_image(5, W, H)
    x = preprocess(pil)[None]
    assert torch.equal(x, model.transform(pil)[None])
    texts = ["a red circle in the top right corner", CAPTION]
    tokens = tokenizer(texts)
    assert torch.equal(tokens, model.tokenize(texts))
    with torch.no_grad():
        assert torch.allclose(clip.encode_image(x, normalize=True), model.encode_image(x), atol=1e-5)
        assert torch.allclose(clip.encode_text(tokens, normalize=True), model.encode_text(tokens), atol=1e-5)
        assert torch.allclose(clip.logit_scale, model.clip.logit_scale)


# ------------------------------------------------------------------------------------------------ dense / regions
def reference_dense(clip, x):
    """MaskCLIP's dense map from open_clip's ViT modules (docs/methods.md §1.2): blocks 0..L-2 as they are, the
    last block's attention reduced to out_proj(v_proj(ln_1(x))), then ln_post, projection, L2; [B, D, gh, gw]."""
    visual = clip.visual
    tokens = visual.conv1(x)                                           # [B, W, gh, gw]
    b, width, gh, gw = tokens.shape
    tokens = tokens.flatten(2).transpose(1, 2)                         # row-major patches
    tokens = torch.cat([visual.class_embedding.expand(b, 1, width), tokens], dim=1) + visual.positional_embedding
    tokens = visual.ln_pre(tokens)
    *blocks, last = visual.transformer.resblocks
    for block in blocks:
        tokens = block(tokens)
    attn = last.attn
    value = F.linear(last.ln_1(tokens), attn.in_proj_weight[2 * width:], attn.in_proj_bias[2 * width:])
    tokens = tokens + attn.out_proj(value)
    tokens = tokens + last.mlp(last.ln_2(tokens))
    dense = F.normalize(visual.ln_post(tokens[:, 1:]) @ visual.proj, dim=-1)   # [B, P, D]
    return dense.reshape(b, gh, gw, -1).permute(0, 3, 1, 2)


@pytest.mark.parametrize("fixture", ["b16", "b32", "b16_wide"])
def test_dense_and_region_features_match_open_clip_modules(fixture, request):
    model = request.getfixturevalue(fixture)
    gh, gw = model.grid
    height, width = model.clip.visual.image_size
    patch = model.clip.visual.patch_size[0]
    x = torch.stack([model.transform(random_image(i, W, H)) for i in range(2)])
    with torch.no_grad():
        dense = model.dense_features(x)
        expected = reference_dense(model.clip, x)
        assert dense.shape == (2, model.embed_dim, gh, gw) == expected.shape
        assert torch.allclose(dense, expected, atol=1e-5)
        assert torch.allclose(model.image_features(x, dense=True)["dense"], expected, atol=1e-5)
        # a box of exactly patch (r, c), in input pixels: RoIAlign (aligned, 1 sample) reads that location alone
        cells = [(0, 0), (0, gw - 1), (gh - 1, 0), (gh // 2, gw // 3)]
        boxes = torch.tensor([[c * patch, r * patch, (c + 1) * patch, (r + 1) * patch] for r, c in cells],
                             dtype=torch.float32)
        regions = model.region_features(x, [boxes, boxes])
        cell_features = torch.stack([expected[i, :, r, c] for i in range(2) for r, c in cells])
        assert torch.allclose(regions, F.normalize(cell_features, dim=-1), atol=1e-5)
        # the patch tokens the methods use: ln_post + projection of the last block's output
        patches = model.image_features(x)["patches"]
        assert patches.shape == (2, gh * gw, model.embed_dim) and (height, width) == (gh * patch, gw * patch)


def test_training_boxes_follow_a_non_square_input(b16_wide):
    """A top-right box of a 400 x 200 original on a 160-high, 224-wide input: x scales by 224/400, y by 160/200."""
    ctx = example_context(b16_wide)
    box = ctx.resize_boxes([[W / 2, 0, W, H / 2]], (W, H))
    assert torch.allclose(box, torch.tensor([[112.0, 0.0, 224.0, 80.0]]))
    mask = b16_wide.box_patch_mask(box).view(10, 14)            # rows 0-4 (80 px), columns 7-13 (112..224 px)
    expected = torch.zeros(10, 14, dtype=torch.bool)
    expected[:5, 7:] = True
    assert torch.equal(mask, expected)


def attention_free_first_block(model):
    """A copy whose first vision block does not mix tokens (attention output zeroed): with MaskCLIP's value-path
    last block, each location's dense feature then depends on its own patch only, so a region's feature can only
    change when pixels under it change. Random attention would otherwise spread any change over the whole map."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        out_proj = model.clip.visual.transformer.resblocks[0].attn.out_proj
        out_proj.weight.zero_()
        out_proj.bias.zero_()
    return model


@pytest.mark.parametrize("fixture", ["b16", "b32", "b16_wide"])
def test_region_feature_changes_only_under_the_changed_box(fixture, request, tmp_path):
    """The evaluation's box path (`Encoder.regions`: original-pixel boxes -> input pixels -> RoIAlign on the dense
    map) on a non-square original: an image black except inside box A (top-right) changes A's feature, not the
    feature of the disjoint box B (bottom-left). A swapped (W, H) box scale or a transposed grid reads elsewhere."""
    model = attention_free_first_block(request.getfixturevalue(fixture))
    box_a = [0.8 * W, 0.0, W, 0.2 * H]
    box_b = [0.0, 0.5 * H, 0.4 * W, H]
    black = Image.new("RGB", (W, H))
    painted = black.copy()
    a = tuple(round(v) for v in box_a)
    painted.paste(random_image(3, a[2] - a[0], a[3] - a[1]), a[:2])
    black.save(tmp_path / "black.png")
    painted.save(tmp_path / "painted.png")
    boxes = torch.tensor([box_a, box_b])
    before, after = (Encoder(model).regions([(str(tmp_path / f), boxes)]) for f in ("black.png", "painted.png"))
    assert before.shape == (2, model.embed_dim)
    assert torch.allclose(after[1], before[1], atol=1e-5)                 # B: untouched pixels, same feature
    assert (after[0] - before[0]).norm() > 0.1                            # A: its pixels changed


# ------------------------------------------------------------------------------------------------ LISM at 336 px
def test_lism_scores_at_vit_l14_336(cfg_dir):
    """LISM's sentence-candidate scores (100 x cosine) equal plain open_clip's on the same crops, at 336 px with
    vision width 1024 projected to 768."""
    model = shallow_model(cfg_dir, "ViT-L-14-336", vision_layers=1 + 1, text_layers=1)
    assert (model.image_size, model.grid, model.embed_dim) == (336, (24, 24), 768)
    image = random_image(7, W, H)
    boxes = [(300.0, 0.0, 400.0, 100.0), (0.0, 0.0, float(W), float(H))]
    sentences = ["A small red circle in the top right corner.", "A big blue square sits at the bottom left."]
    matches = match_image(model, image, sentences, boxes)
    clip = model.clip.eval()
    preprocess = open_clip.image_transform(336, is_train=False, resize_mode="squash",
                                           mean=open_clip.OPENAI_DATASET_MEAN, std=open_clip.OPENAI_DATASET_STD)
    crops = [image] + [image.crop(tuple(round(v) for v in b)) for b in boxes]
    with torch.no_grad():
        images = clip.encode_image(torch.stack([preprocess(c) for c in crops]), normalize=True)
        texts = clip.encode_text(open_clip.get_tokenizer("ViT-L-14-336")(sentences), normalize=True)
    scores = 100 * texts @ images.T                                   # [sentences, 1 + boxes]
    assert images.shape == (3, 768)
    assert torch.allclose(scores[:, 0], scores[:, 2], atol=1e-3)      # the whole-image box is the global image
    for m in matches:
        assert m.candidate == int(scores[m.sentence_index].argmax())
        assert abs(m.score - float(scores[m.sentence_index, m.candidate])) < 1e-3


def test_shallow_config_overrides_only_depth():
    cfg, real = shallow_config("ViT-L-14-336", vision_layers=2), open_clip.get_model_config("ViT-L-14-336")
    assert cfg["vision_cfg"] == dict(real["vision_cfg"], layers=2)
    assert cfg["text_cfg"] == dict(real["text_cfg"], layers=1) and cfg["embed_dim"] == real["embed_dim"]


# ------------------------------------------------------------------------------------------------ EVA02-CLIP (timm)
@pytest.fixture(scope="module")
def eva(cfg_dir):
    """open_clip's `EVA02-B-16` (timm `eva02_base_patch16_clip_224` image tower, `CustomTextCLIP`), random init,
    2 vision and 1 text blocks; tests/real/ runs the full depth."""
    return shallow_timm_model(cfg_dir, "EVA02-B-16")


def eva_reference(clip, x, dense: bool):
    """EVA's tokens through timm's own modules: blocks as timm runs them (rotary embedding included), the last one
    with an attention mask that lets each token attend only to itself when `dense` (MaskCLIP: the value path);
    then the trunk's norm and head (EVA-CLIP's projection). -> [B, 1 + P, D] projected, not normalised."""
    trunk = clip.visual.trunk
    tokens, rope = trunk._pos_embed(trunk.patch_embed(x))
    tokens = trunk.norm_pre(tokens)
    *blocks, last = trunk.blocks
    for block in blocks:
        tokens = block(tokens, rope=rope)
    n = tokens.shape[1]
    self_only = torch.full((n, n), float("-inf")).fill_diagonal_(0.0) if dense else None
    tokens = last(tokens, rope=rope, attn_mask=self_only)
    return trunk.head(trunk.fc_norm(trunk.norm(tokens)))


def test_eva02_geometry_tokens_and_dense_features_match_timm(eva):
    assert type(eva.clip).__name__ == "CustomTextCLIP" and type(eva.clip.visual.trunk).__name__ == "Eva"
    assert (eva.image_size, eva.patch_size, eva.grid, eva.embed_dim, eva.context_length) == (224, 16, (14, 14), 512, 77)
    assert (eva.clip.visual.trunk.patch_embed.proj.out_channels == 768
            and eva.text_tower.ln_final.normalized_shape == (512,))
    x = torch.stack([eva.transform(random_image(i, W, H)) for i in range(2)])
    text = eva.tokenize(["a red circle in the top right corner", CAPTION])
    with torch.no_grad():
        features = eva.image_features(x, dense=True)
        assert features["patches"].shape == (2, 196, 512) and features["hidden"].shape == (2, 196, 768)
        assert features["dense"].shape == (2, 512, 14, 14)
        tokens = eva_reference(eva.clip, x, dense=False)
        assert torch.allclose(features["global_"], F.normalize(tokens[:, 0], dim=-1), atol=1e-5)
        assert torch.allclose(features["global_"], eva.clip.encode_image(x, normalize=True), atol=1e-5)
        scale = tokens.abs().max()                                     # random init: small projected values
        assert torch.allclose(features["patches"] / scale, tokens[:, 1:] / scale, atol=1e-5)
        expected = F.normalize(eva_reference(eva.clip, x, dense=True)[:, 1:], dim=-1)
        expected = expected.reshape(2, 14, 14, -1).permute(0, 3, 1, 2)
        assert torch.allclose(features["dense"], expected, atol=1e-5)
        assert torch.allclose(eva.dense_features(x), expected, atol=1e-5)
        cells = [(0, 0), (0, 13), (13, 0), (7, 4)]                    # RoIAlign of a one-patch box reads its cell
        boxes = torch.tensor([[c * 16, r * 16, (c + 1) * 16, (r + 1) * 16] for r, c in cells], dtype=torch.float32)
        regions = eva.region_features(x, [boxes, boxes])
        assert torch.allclose(regions, torch.stack([expected[i, :, r, c] for i in range(2) for r, c in cells]),
                              atol=1e-5)
        words = eva.text_features(text)
        assert words["tokens"].shape == (2, int(text.argmax(-1).max()) + 1, 512)
        assert torch.allclose(words["global_"], eva.clip.encode_text(text, normalize=True), atol=1e-5)


@pytest.mark.parametrize("run", ["harmoclip", "fsc_clip_lora", "goal", "degla"])
def test_methods_train_at_eva02_b16(eva, run):
    _, trainer, _, scalars, before, missing = train_one_step(eva, run)
    assert missing == [] and all(torch.isfinite(v) for k, v in scalars.items() if k.startswith("loss"))
    moved = [not torch.equal(b, p) for b, p in zip(before, trainer.params)]
    assert all(m or not p.grad.any() for m, p in zip(moved, trainer.params)) and sum(moved) > len(moved) / 2


def test_harmoclip_unlocks_the_last_eva02_blocks(eva):
    method = get_method("harmoclip")(unlocked_vision_layers=1)
    module = method.build(copy.deepcopy(eva))
    trunk = module.model.clip.visual.trunk
    frozen = {n for n, p in trunk.named_parameters() if not p.requires_grad}
    assert {"cls_token", "pos_embed", "patch_embed.proj.weight"} <= frozen
    assert all(n in frozen for n, _ in trunk.blocks[0].named_parameters(prefix="blocks.0"))
    assert not any(n.startswith(("blocks.1.", "norm.", "head.")) for n in frozen)


def test_an_eva02_checkpoint_at_224_px_loads_at_another_input_size(eva):
    """The absolute position table of a 14 x 14 checkpoint is resampled to the model's 10 x 10 grid (bicubic, as
    timm and open_clip resample), the class position kept; the rotary embedding follows the grid by itself."""
    from clipfinetune.models import load_state_dict_into

    small = copy.deepcopy(eva)
    small.clip.visual.set_input_size(160)
    assert small.grid == (10, 10) and small.image_size == 160
    state = eva.clip.state_dict()
    load_state_dict_into(small.clip, state)
    table = state["visual.trunk.pos_embed"]
    grid = table[:, 1:].reshape(1, 14, 14, -1).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(10, 10), mode="bicubic", antialias=True, align_corners=False)
    loaded = small.clip.visual.trunk.pos_embed
    assert torch.equal(loaded[:, :1], table[:, :1])
    assert torch.allclose(loaded[:, 1:], expected.permute(0, 2, 3, 1).reshape(1, 100, -1), atol=1e-6)
    with torch.no_grad():
        features = small.image_features(torch.randn(1, 3, 160, 160), dense=True)
    assert features["patches"].shape == (1, 100, 512) and features["dense"].shape == (1, 512, 10, 10)
