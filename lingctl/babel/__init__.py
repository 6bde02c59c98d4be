"""lingctl babel: copy, sync and verify trees between local disks and S3-compatible stores."""
