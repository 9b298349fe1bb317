"""One training loop for every method: device, precision, DDP, schedule, accumulation, checkpoints, logging.

    trainer = Trainer(method, model, source, TrainConfig(...), checkpoint_dir=..., fingerprint=...)
    resumed = trainer.resume()      # checkpoint_dir/last.pt, when its fingerprint matches
    with Monitor(live_dir, trainer.total_steps, trainer.step, resumed) as monitor:
        module = trainer.fit(monitor)
"""
from clipfinetune.distributed import DistInfo, cleanup, init_distributed

from .checkpoint import CheckpointError, fingerprint, load_checkpoint, save_checkpoint
from .config import TrainConfig, merge_train_settings, per_rank_batch_size
from .loop import BatchSource, NonFiniteLossError, Trainer
from .monitor import Monitor

__all__ = ["BatchSource", "CheckpointError", "DistInfo", "Monitor", "NonFiniteLossError", "TrainConfig", "Trainer",
           "cleanup", "fingerprint", "init_distributed", "load_checkpoint", "merge_train_settings",
           "per_rank_batch_size", "save_checkpoint"]
