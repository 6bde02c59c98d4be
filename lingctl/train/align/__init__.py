"""``lingctl train align``: one batch through two set-ups, every module compared, traces for another machine."""
