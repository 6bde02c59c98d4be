"""Options shared by several commands, defined once (as huggingface_hub's CLI does)."""

from __future__ import annotations

from typing import Annotated

import typer

from lingctl.core.storage import S3Options

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout (JSON).")]

EndpointOpt = Annotated[str | None, typer.Option(
    "--endpoint-url", metavar="URL", help="S3 endpoint, e.g. http://127.0.0.1:9000 (default: AWS_ENDPOINT_URL).")]
RegionOpt = Annotated[str | None, typer.Option(
    "--region", help="S3 region (default: AWS_REGION / AWS_DEFAULT_REGION / profile, else us-east-1).")]
ProfileOpt = Annotated[str | None, typer.Option("--profile", help="AWS profile (default: AWS_PROFILE).")]
PathStyleOpt = Annotated[bool | None, typer.Option(
    "--path-style/--virtual-host",
    help="S3 addressing (default: path style with a custom endpoint, virtual-host on AWS).")]
RetriesOpt = Annotated[int, typer.Option("--retries", min=1, help="Attempts per S3 request before giving up.")]


def s3_options(endpoint_url: str | None, region: str | None, profile: str | None, path_style: bool | None,
               retries: int = 3) -> S3Options:
    return S3Options(endpoint_url=endpoint_url, region=region, profile=profile, path_style=path_style,
                     max_attempts=retries)
