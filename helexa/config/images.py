"""The router's `[images]` section: what a client may send as images, and whether the router
fetches images by URL (helexa/router/images.py applies it)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from helexa.config.fields import RELOAD, field_meta


class ImagesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    max_per_request: Annotated[int, field_meta(
        "Most images one request may carry (0: images are refused).", RELOAD, ge=0)] = 16
    max_pixels: Annotated[int, field_meta(
        "Most pixels (width x height) of one image as decoded; checked from the file's header "
        "before any pixel is decoded. The model resizes within its own bounds after this.",
        RELOAD, ge=1)] = 32 * 2**20
    max_bytes: Annotated[int, field_meta(
        "Largest encoded image (a data: URL's decoded bytes, a fetched file). Images arrive in "
        "the request body: server.max_body_bytes bounds them all together.",
        RELOAD, ge=1)] = 20 * 2**20
    fetch_urls: Annotated[bool, field_meta(
        "Fetch http(s) image URLs (OpenAI image_url, Anthropic url sources) from the hosts in "
        "fetch_hosts; off: only data: URLs and base64 images are taken.", RELOAD)] = False
    fetch_hosts: Annotated[list[str], field_meta(
        "Hosts image URLs may name when fetch_urls is on: exact names, or \"*.example.com\" "
        "for its subdomains. Redirects are not followed.",
        RELOAD)] = msgspec.field(default_factory=list)
    fetch_timeout_secs: Annotated[float, field_meta(
        "Longest one image fetch may take, connection to last byte.", RELOAD, gt=0)] = 10.0
