"""Supervising a training job: the launcher (its entry, torchrun's attempts, the restart loop, the hang detector
and the signals it passes on), and what workers and launcher share about health and divergence."""
