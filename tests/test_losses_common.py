"""common.py: CLIP's symmetric InfoNCE against the float64 reference, and its DDP equivalence."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from reference import fsc_clip_reference as ref

from clipfinetune.losses.common import clip_contrastive_loss, contrastive_labels, gather_features, world

N, DIN, D = 6, 5, 4


def unit_features(seed, n=N, d=D):
    g = torch.Generator().manual_seed(seed)
    return (F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1),
            F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_clip_contrastive_loss_matches_reference_values_and_gradients(label_smoothing):
    image, text = unit_features(0)
    args_m = [x.clone().requires_grad_(True) for x in (image, text, torch.tensor(3.0, dtype=torch.float64))]
    args_r = [x.detach().clone().requires_grad_(True) for x in args_m]
    out_m = clip_contrastive_loss(*args_m, label_smoothing=label_smoothing)
    out_r = ref.clip_loss(*args_r, label_smoothing=label_smoothing)
    torch.testing.assert_close(out_m, out_r, rtol=1e-9, atol=1e-12)
    out_m.backward()
    out_r.backward()
    for a, b in zip(args_m, args_r):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-7, atol=1e-10)


def test_clip_contrastive_loss_is_symmetric_in_its_two_directions():
    image, text = unit_features(1)
    scale = torch.tensor(7.0, dtype=torch.float64)
    torch.testing.assert_close(clip_contrastive_loss(image, text, scale), clip_contrastive_loss(text, image, scale))
    # and it is not the one-directional loss (the reference's two directions differ on random features)
    one_way = F.cross_entropy(scale * image @ text.T, torch.arange(N))
    assert not torch.allclose(clip_contrastive_loss(image, text, scale), one_way)


def test_gradient_is_finite_at_a_large_logit_scale():
    image, text = (x.float().requires_grad_(True) for x in unit_features(2))
    scale = torch.tensor(100.0, requires_grad=True)
    clip_contrastive_loss(image, text, scale).backward()
    assert all(torch.isfinite(x.grad).all() for x in (image, text, scale))


def test_single_process_gather_is_identity_and_labels_are_the_diagonal():
    image, text = unit_features(3)
    assert world() == (0, 1)
    out = gather_features(image, text)
    assert out[0] is image and out[1] is text
    assert torch.equal(contrastive_labels(N, "cpu"), torch.arange(N))


# ---- DDP: 2 gloo processes on halves of the batch == 1 process on the whole batch -------------------------

def shared_model_inputs():
    """A tiny 'model' (two linear towers + logit scale) and the global batch it embeds."""
    g = torch.Generator().manual_seed(4)
    params = {"w_image": torch.randn(DIN, D, generator=g, dtype=torch.float64),
              "w_text": torch.randn(DIN, D, generator=g, dtype=torch.float64),
              "log_scale": torch.tensor(1.5, dtype=torch.float64)}
    x_image = torch.randn(N, DIN, generator=g, dtype=torch.float64)
    x_text = torch.randn(N, DIN, generator=g, dtype=torch.float64)
    return params, x_image, x_text


def model_loss(params, x_image, x_text):
    image = F.normalize(x_image @ params["w_image"], dim=-1)
    text = F.normalize(x_text @ params["w_text"], dim=-1)
    return clip_contrastive_loss(image, text, params["log_scale"].exp())


def _ddp_worker(rank, world_size, init_file, out_dir):
    torch.set_num_threads(1)                        # forked child: keep OpenMP out of it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        params, x_image, x_text = shared_model_inputs()
        params = {k: v.requires_grad_(True) for k, v in params.items()}
        rows = slice(rank * N // world_size, (rank + 1) * N // world_size)
        loss = model_loss(params, x_image[rows], x_text[rows])
        loss.backward()
        grads = {k: v.grad.clone() for k, v in params.items()}
        for g in grads.values():                    # what DDP does to every parameter gradient
            dist.all_reduce(g)
            g /= world_size
        losses = [torch.zeros((), dtype=torch.float64) for _ in range(world_size)]
        dist.all_gather(losses, loss.detach())
        if rank == 0:
            torch.save({"grads": grads, "loss": torch.stack(losses).mean()}, os.path.join(out_dir, "out.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_give_the_gradients_of_one_process_on_the_concatenated_batch():
    params, x_image, x_text = shared_model_inputs()
    params = {k: v.requires_grad_(True) for k, v in params.items()}
    loss = model_loss(params, x_image, x_text)
    loss.backward()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_ddp_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True,
                           start_method="fork")  # fork: no re-import of torch, well under a second
        out = torch.load(os.path.join(tmp, "out.pt"), weights_only=True)
    torch.testing.assert_close(out["loss"], loss.detach())
    for k, v in params.items():
        torch.testing.assert_close(out["grads"][k], v.grad, rtol=1e-7, atol=1e-10, msg=k)
