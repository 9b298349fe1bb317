"""`python -m research.mulclip_terms`: what MulCLIP's local terms do to the backbone during its run (issue 35).

A probe, not a stage: it reads a workspace's `params.yaml`, `data/shards/` and `models/base/` (run `dvc repro
shards pretrain` first) and trains a MulCLIP run exactly as `train@<run>` does (the run's settings from
clipfinetune/runs.py `resolve_runs`: its weights, kwargs and regime; the same ShardLoader, Trainer, schedule and
gradient clip). Before every optimiser step it also back-propagates each term group on its own, through the same
forward:

- `global`: L_global (image vs long caption + lambda_short x image vs summary, eq. 3);
- `word`:   lambda_W x L_Word (word-patch reconstruction, eqs. 5-8);
- `sub`:    lambda_S x L_Sub (subcaption-aggregated patch alignment, eqs. 9-10);

and records, on the backbone (the CLIP's own parameters; the calibration modules and contrast heads are new and
reported apart): each group's gradient norm, the cosine of the word / sub gradient with the global one, and the
share of the clipped update that the global gradient keeps (its component along the summed gradient, after the
clip). The step itself is the run's (all terms), so the trajectory is the run's, not three separate ones.

    python -m research.mulclip_terms [--root .] [--run mulclip] [--out terms.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

GROUPS = {"global": ("contrastive", "contrastive_short"), "word": ("word_patch",), "sub": ("subcaption_patch",)}


def flat_grad(loss: torch.Tensor, params: list) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-12))


def step_record(terms: dict, backbone: list, new: list, clip: float) -> dict:
    """Per-group gradients of one step's terms (through the step's own forward) on the backbone and the new
    modules. `global_kept`: the clipped full step's progress along the global gradient on the backbone, relative to
    the clipped step the global group alone would take (1 = the local terms cost the global objective nothing)."""
    losses = {g: sum(terms[n] for n in names if n in terms) for g, names in GROUPS.items()}
    live = {g: v for g, v in losses.items() if torch.is_tensor(v) and v.requires_grad and float(v.detach()) != 0.0}
    n_bb = sum(p.numel() for p in backbone)
    grads = {g: flat_grad(v, backbone + new) for g, v in live.items()}
    total = sum(grads.values())

    def clip_scale(g):          # the Trainer clips the global norm over backbone and new modules together
        return min(1.0, clip / float(g.norm())) if clip > 0 else 1.0

    rec = {"terms": {n: round(float(t.detach()), 4) for n, t in terms.items()},
           "grad_norm": {g: round(float(v[:n_bb].norm()), 4) for g, v in grads.items()},
           "new_modules_grad_norm": {g: round(float(v[n_bb:].norm()), 4) for g, v in grads.items()},
           "clip_scale": round(clip_scale(total), 4)}
    if "global" in grads:
        g = grads["global"][:n_bb]
        rec["cos_with_global"] = {k: round(cosine(v[:n_bb], g), 4) for k, v in grads.items() if k != "global"}
        rec["global_kept"] = round(clip_scale(total) * float(total[:n_bb] @ g)
                                   / (clip_scale(grads["global"]) * float(g @ g)), 4)
    return rec


def summarise(records: list[dict], spans=((0, 10), (10, None))) -> dict:
    out = {}
    for lo, hi in spans:
        part = records[lo:hi]
        if not part:
            continue
        key = f"steps {lo + 1}-{lo + len(part)}"
        mean = {}
        for field in ("grad_norm", "new_modules_grad_norm", "cos_with_global"):
            names = {k for r in part for k in r.get(field, {})}
            mean[field] = {k: round(sum(r[field][k] for r in part) / len(part), 3) for k in sorted(names)}
        for field in ("global_kept", "clip_scale"):
            if all(field in r for r in part):
                mean[field] = round(sum(r[field] for r in part) / len(part), 3)
        out[key] = mean
    return out


def main(argv: list[str] | None = None) -> dict:
    import yaml

    from clipfinetune.data.loader import ExampleContext, ShardLoader
    from clipfinetune.methods import get_method
    from clipfinetune.models import load_model
    from clipfinetune.runs import resolve_runs
    from clipfinetune.train.session import training_session

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=".", help="workspace with params.yaml, data/shards and models/base")
    ap.add_argument("--run", default="mulclip", help="a run of params.yaml `runs` whose method is mulclip")
    ap.add_argument("--out", default="", help="also write the per-step records and the summary as JSON here")
    args = ap.parse_args(argv)
    root = Path(args.root)
    params = yaml.safe_load((root / "params.yaml").read_text())
    run = resolve_runs(params)[args.run]                 # what train@<run> trains with (data/runs/<run>.json)
    with training_session(run["train"], run["precision"], "cpu") as session:    # train@'s wiring
        cfg = session.cfg
        method = get_method(run["method"])(**run["config"])
        model = load_model(f"local-dir:{root / 'models' / 'base'}", device=session.dist.device)
        ctx = ExampleContext.of_model(model)
        loader = ShardLoader(root / "data" / "shards", "train", method, ctx, batch_size=cfg.micro_batch_size,
                             seed=cfg.seed, num_workers=cfg.workers, epoch_unit=cfg.epoch_unit,
                             epoch_samples=cfg.epoch_samples, accum_steps=cfg.accum_steps)   # the run's batches
        trainer = session.trainer(method, model, loader, desc=f"terms@{args.run}")
        backbone = [p for p in model.parameters() if p.requires_grad]
        new = [p for p in trainer.loss_fn.parameters() if p.requires_grad]
        records: list[dict] = []
        compute = trainer.compute_gradients
        t0 = time.perf_counter()

        def probed(micro_batches):
            terms = trainer.loss_fn(trainer._forward(micro_batches[0]))
            records.append({"step": len(records) + 1, **step_record(terms, backbone, new, cfg.grad_clip)})
            r = records[-1]
            print(f"step {r['step']}: grad norms {r['grad_norm']}, cos with global {r.get('cos_with_global')}, "
                  f"global kept {r.get('global_kept')} ({time.perf_counter() - t0:.0f} s)", flush=True)
            return compute(micro_batches)

        trainer.compute_gradients = probed
        trainer.fit()
    result = {"run": args.run, "kwargs": run["config"], "regime": run["train"], "steps": len(records),
              "summary": summarise(records), "records": records}
    print(json.dumps(result["summary"], indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
