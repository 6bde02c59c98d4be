"""Evaluation tasks scored with flood's engine, one model or every checkpoint of a run (``flood eval``)."""
