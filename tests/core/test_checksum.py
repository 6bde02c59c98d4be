from __future__ import annotations

import io
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from lingctl.core.checksum import Crc64, crc64_bytes, crc64_file, crc64_stream


def test_known_vectors() -> None:
    # CRC-64/NVME check value (the CRC of "123456789"), and the value S3 itself returns for b"hello".
    assert crc64_bytes(b"123456789").value == 0xAE8B14860A799888
    assert crc64_bytes(b"hello").tagged() == "crc64nvme:M3eFcAZSQlc="
    assert crc64_bytes(b"").value == 0


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=4096), st.binary(max_size=4096), st.binary(max_size=512))
def test_parts_combine_to_the_whole(a: bytes, b: bytes, c: bytes) -> None:
    whole = crc64_bytes(a + b + c)
    combined = crc64_bytes(a)
    combined.extend(crc64_bytes(b))
    combined.extend(crc64_bytes(c))
    assert (combined.value, combined.length) == (whole.value, whole.length)


def test_stream_and_file_agree(tmp_path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 7)
    path = tmp_path / "f"
    path.write_bytes(data)
    expected = crc64_bytes(data)
    assert crc64_stream(io.BytesIO(data), chunk=65536).value == expected.value
    assert crc64_file(path).tagged() == expected.tagged()
    running = Crc64()
    running.update(data[:10])
    running.update(memoryview(data)[10:])
    assert running.value == expected.value
