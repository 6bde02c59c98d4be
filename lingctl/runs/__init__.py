"""A training run's directory without torch: its layout and manifest, the files lingctl owns there, its checkpoint
listing, its JSONL records and incidents, its status, and the settings it was started with (train_config.py).
Read by train, ``train status``, the launcher's hang detector and ``flood eval``; nothing here imports torch,
the training code or pcache."""
