"""Stage `pretrain`: the small base CLIP, trained from scratch on the short captions of `pretrain.sources` ->
models/base/.

Global contrastive (the plain CLIP method) on every image of those sources with one of its captions drawn at
random each epoch, read by the sources' readers (not the shards: they need LISM pairs, and LISM on the sample
world uses this model). On the sample world the source is `pretrain`, the pretraining-only split.
`pretrain.one_colour_share` of every batch holds images of one colour (`sample.pretrain.sources.CaptionPairSource`).
Before the contrastive steps, `pretrain.label_warmup_steps` steps train the image tower to name the shapes and colours
of each image (`sample.pretrain.label_warmup`, the LiT-style supervised start, run by the same Trainer; 0 = off), and
with `pretrain.label_warmup_regions` each object's from its RoIAligned dense feature; `pretrain.region_text_weight`
adds the region-text term to the contrastive steps (`sample.pretrain.method`, `sample.pretrain.loss`: each object's
dense feature against the batch's object names). The curves: dvclive/pretrain/ (contrastive) and
dvclive/pretrain/label_warmup/.

With real weights (`model.pretrained` set: an open_clip tag, a checkpoint file or an exported folder) nothing is
trained: the given weights are exported unchanged into models/base/ (the open_clip local-dir layout), and
dvclive/pretrain/ holds only skipped.json, which records why (a from-scratch run removes that note again). The
weights themselves are not a DVC dependency (the param is): after changing a file or folder in place, run
`dvc repro -f pretrain`.

Resumable: checkpoints/pretrain/label_warmup/last.pt and checkpoints/pretrain/last.pt (gitignored, not DVC outs) carry
a fingerprint of the declared params, the stage's inputs and code; a killed run re-run with the same fingerprint
resumes (a finished warm-up restores its weights and is not run again), anything else starts over. The curves grow
beside them (checkpoints/pretrain/dvclive) and are copied to dvclive/pretrain/ at the end (not a persisted output,
so DVC's run cache can restore the stage).
Ranks: from scratch, as many as split `pretrain.batch_size` evenly (`compute.train_nproc`, stages/_common.py); with
real weights one process whatever `compute` says (torchrun by hand works too: rank 0 exports, the others return).
`pretrain.batch_size` is the GLOBAL batch, as `train.batch_size`, of both phases: each of the N ranks takes 1/N of
it, so steps and schedule do not depend on N.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages._common import ROOT, TrainingBatch, compute_device, source_specs, stage_inputs, start

GROUP_KEY = "colour"        # record.extra key (COCO images[]) of the pretraining split: the group of one_colour_share
LABEL_KEY = "labels"        # record.extra key: the shapes and colours the label warm-up predicts
REGION_KEY = "regions"      # record.extra key: every object's box, labels and name (warm-up and region-text terms)
OWN_KEYS = ("sources", "one_colour_share", "label_warmup_steps", "label_warmup_lr", "label_warmup_regions",
            "region_text_weight", "keep_checkpoint")   # keys TrainConfig does not hold


def training_batch(args, params) -> TrainingBatch | None:
    """Ranks for the launcher: from scratch, by the global batch; with real weights one process (it only exports)."""
    if params["model.pretrained"]:
        return None
    return TrainingBatch(int(params["pretrain.batch_size"]), 1, "pretrain.batch_size")


def main() -> None:
    _, params, log = start(__doc__, "pretrain", ranks=training_batch)
    name, pretrained, precision = params["model.name"], params["model.pretrained"], params["model.precision"]
    settings = dict(params["pretrain"])
    sources = source_specs(params, params["pretrain.sources"])
    out, live_dir = ROOT / "models" / "base", ROOT / "dvclive" / "pretrain"

    from clipfinetune.io import write_json
    from clipfinetune.models import export_model, load_model, quick_gelu_setting

    quick_gelu = quick_gelu_setting(params["model.quick_gelu"])   # for weights that do not record it
    if pretrained:
        log.info("model.pretrained=%r: exporting these weights unchanged to %s (no pretraining)", pretrained, out)
        if int(os.environ.get("RANK", "0")) == 0:          # under torchrun, one writer
            export_model(load_model(name, pretrained, quick_gelu=quick_gelu), out)
            shutil.rmtree(live_dir, ignore_errors=True)    # no curves of an earlier from-scratch run beside the note
            write_json(live_dir / "skipped.json", {"pretrained": pretrained, "model": name,
                                                   "reason": "model.pretrained is set: weights exported unchanged"})
        params.check_all_read()
        return

    import dataclasses

    from clipfinetune.data.readers import read_source
    from clipfinetune.methods.clip import ClipMethod
    from clipfinetune.sample.pretrain.label_warmup import label_warmup
    from clipfinetune.sample.pretrain.method import PretrainMethod
    from clipfinetune.sample.pretrain.sources import CaptionPairSource
    from clipfinetune.train import fingerprint
    from clipfinetune.train.session import training_session

    label_steps, region_text_weight = int(settings["label_warmup_steps"]), float(settings["region_text_weight"])
    warmup_regions = bool(settings["label_warmup_regions"]) and label_steps > 0
    checkpoints = ROOT / "checkpoints" / "pretrain"
    live_work = checkpoints / "dvclive"                  # survives a kill beside the checkpoints it resumes from
    with training_session({k: v for k, v in settings.items() if k not in OWN_KEYS}, precision,
                          compute_device(), batch_param="pretrain.batch_size", log=log) as session:
        dist, cfg = session.dist, session.cfg
        if dist.is_main:
            (live_dir / "skipped.json").unlink(missing_ok=True)   # a note of an earlier run with model.pretrained
        model = load_model(name, device=dist.device)
        records = [r for n, spec in sources.items() for r in read_source(n, spec)]
        source = CaptionPairSource(records, model.transform, model.tokenize, cfg.micro_batch_size, cfg.seed,
                                   dist.rank, dist.world_size, group_key=GROUP_KEY,
                                   group_share=float(settings["one_colour_share"]),
                                   label_key=LABEL_KEY if label_steps or region_text_weight else "",
                                   region_key=REGION_KEY if warmup_regions or region_text_weight else "")
        log.info("pretraining %s from scratch on %d images: %d epochs x %d steps, %s on %s", name,
                 len(source.image_ids), cfg.epochs, len(source), cfg.precision, dist.device)
        fp = fingerprint(params.stage, {"model": {"name": name, "pretrained": pretrained, "precision": precision},
                                        "pretrain": settings}, stage_inputs(params.stage), dist.world_size)
        if label_steps:
            log.info("label warm-up of the image tower: %d steps over %s", label_steps, source.label_names)
            lr = float(settings["label_warmup_lr"])
            objective, batches = label_warmup(
                source.images, source.labels, embed_dim=model.embed_dim, steps=label_steps,
                batch_size=session.global_batch, lr=lr, seed=cfg.seed, normalize=source.normalize,
                regions=source.regions if warmup_regions else None, rank=dist.rank, world_size=dist.world_size)
            warmup_cfg = dataclasses.replace(cfg, epochs=1, lr=lr, grad_clip=0.0)    # the contrastive schedule's
            warmup = session.trainer(objective, model, batches, cfg=warmup_cfg,        # warm-up and wd, no clip
                                     checkpoint_dir=checkpoints / "label_warmup", fingerprint=fp,
                                     desc="label warm-up")
            objective.final_model(session.fit(warmup, live_work / "label_warmup"), model)   # the text tower thawed
        method = PretrainMethod(region_text_weight) if region_text_weight > 0 else ClipMethod()
        trainer = session.trainer(method, model, source, checkpoint_dir=checkpoints, fingerprint=fp, desc="pretrain")
        session.fit(trainer, live_work)
        session.export(model, out, live_dir=live_work, note="device.json", publish_to=live_dir,
                       checkpoint_dir=checkpoints,
                       keep_checkpoint=settings["keep_checkpoint"])
        log.info("exported %s", out)
        params.check_all_read()


if __name__ == "__main__":
    main()
