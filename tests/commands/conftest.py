from tests.flood.conftest import text_ckpt, tiny_ckpt  # noqa: F401  (checkpoint fixtures shared with flood tests)
