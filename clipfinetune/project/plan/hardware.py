"""Hardware and ranks: the GPUs this host shows, each training stage's ranks (clipfinetune.compute's rules), and a
vLLM server beside the ranks."""
from __future__ import annotations

import os
from urllib.parse import urlparse

from clipfinetune import compute as rules
from clipfinetune.project.plan.common import LOCAL_HOSTS, Refusal, _get, _producing


def visible_hardware() -> tuple[int, str]:
    """(GPUs this process sees, the first one's name); (0, "cpu") without CUDA."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return 0, "cpu"
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


# ---------------------------------------------------------------------------------------------- stage rows
def _training_ranks(row, global_batch, accum, param, compute, gpus, most, hardware, device, refusals, warnings):
    try:
        k = rules.training_ranks(compute, global_batch, most, hardware.nodes, accum, param)
    except rules.ComputeError as e:
        refusals.append(Refusal(row.stage, e.param, str(e), e.fixes))
        return False
    row.device, row.ranks, row.gpus = device, k * hardware.nodes, gpus[:k]
    row.global_batch, row.rank_batch = global_batch, global_batch // (k * hardware.nodes)
    if gpus and k < len(gpus):
        fixes = [f"{param}: {b}" for b in rules.batch_fixes(global_batch, len(gpus) * hardware.nodes, accum)]
        warnings.append(f"{row.stage}: {k} of {len(gpus)} GPUs ({param} {global_batch} splits evenly over no more): "
                        f"GPU(s) {','.join(gpus[k:])} idle; to use all {len(gpus)}: {' or '.join(fixes)}")
    return True


def _llm_beside_ranks(stages, params, compute, hardware, asks_llm: bool) -> tuple[list[Refusal], list[str]]:
    """vLLM beside training: a server on this host (negatives.base_url local) holds ~0.9 of a card; the ranks must
    not use that card (`compute.llm_gpus` keeps the last visible ones for it). `asks_llm`: a negatives stage of
    the DAG is not up to date, so it will ask the server."""
    neg = _producing(stages, "negatives")
    backend = _get(params, "negatives.backend")
    host = urlparse(str(_get(params, "negatives.base_url") or "")).hostname or ""
    local = host in LOCAL_HOSTS or host == os.uname().nodename
    uses_gpus = compute["device"] != "cpu" and hardware.gpus > 0
    refusals, warnings = [], []
    if not (neg and backend == "server" and local and uses_gpus):
        if compute["llm_gpus"] and uses_gpus:
            warnings.append(f"compute.llm_gpus {compute['llm_gpus']} keeps GPU(s) for an LLM server, but no "
                            "negatives stage asks one on this host: compute.llm_gpus: 0 gives them to the ranks")
        return refusals, warnings
    if not asks_llm:
        warnings.append(f"{', '.join(neg)} is up to date: the vLLM server is not needed (stop it; compute.llm_gpus: 0 "
                        "gives its card to the ranks)")
        return refusals, warnings
    if compute["llm_gpus"] == 0:
        last = hardware.gpus - 1
        refusals.append(Refusal(neg[0], "compute.llm_gpus",
                                f"negatives.base_url {_get(params, 'negatives.base_url')} "
                                "is a vLLM server on this host: "
                                "it holds ~0.9 of a card, and with compute.llm_gpus 0 every model stage puts a rank on "
                                "that card too",
                                [(f"compute.llm_gpus: 1 and start the server on the last card: CUDA_VISIBLE_DEVICES="
                                  f"{last} vllm serve {_get(params, 'negatives.model')} --generation-config vllm"),
                                 "negatives.backend: offline (vLLM inside the stage: the card is free when it ends)"]))
    return refusals, warnings
