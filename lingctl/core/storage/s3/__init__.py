"""S3-compatible object stores: the store, its HTTP client, request signing and parallel listing."""
