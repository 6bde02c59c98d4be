"""A training run's directory without torch: its layout and manifest, the files lingctl owns there, its checkpoint
listing and its JSONL records. Read by train, ``train status``, the watchdog and ``flood eval``."""
