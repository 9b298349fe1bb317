"""One training loop for every method: device, precision, DDP, schedule, accumulation, checkpoints, logging.

    trainer = Trainer(method, model, source, TrainConfig(...), checkpoint_dir=..., live_dir=..., fingerprint=...)
    module = trainer.fit()          # resumes from checkpoint_dir/last.pt when its fingerprint matches
"""
from clipfinetune.distributed import DistInfo, cleanup, init_distributed

from .checkpoint import CheckpointError, fingerprint, load_checkpoint, save_checkpoint
from .config import TrainConfig, merge_train_settings, per_rank_batch_size
from .loop import BatchSource, NonFiniteLossError, Trainer

__all__ = ["BatchSource", "CheckpointError", "DistInfo", "NonFiniteLossError", "TrainConfig", "Trainer", "cleanup",
           "fingerprint", "init_distributed", "load_checkpoint", "merge_train_settings", "per_rank_batch_size",
           "save_checkpoint"]
