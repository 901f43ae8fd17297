"""trainrun: a config-driven runner for distributed PyTorch training."""
