"""Plan -> torch.distributed. Never searches."""
