"""Image URLs -> encoded image bytes (no JAX: the front end runs it, `LLM` too).

1. `MediaConnector` holds the rules (vLLM's names): `file://` URLs are read only under
   `allowed_local_media_path` (the path resolved first, so `..` and symlinks that leave the
   directory are refused); `http://` / `https://` URLs are fetched, only from
   `allowed_media_domains` when that is set, within `fetch_timeout` seconds
   (`VLLM_IMAGE_FETCH_TIMEOUT`, default 5) and `max_bytes`, redirects followed unless
   `VLLM_MEDIA_URL_ALLOW_REDIRECTS=0` (each hop's host checked again).
2. `get(url, field)` -> bytes, or `ImageError` naming `field` (refused scheme, path or domain,
   refused connection, timeout, non-200, too large). It blocks: the front end runs it on its own
   threads (`serving.images.ImageFetcher`); `LLM` calls it inline. `data:` URLs and the decoding
   are `processor.load_image`'s.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable

from jaxinfer.vision.processor import ImageError

DEFAULT_MAX_BYTES = 20 << 20  # encoded bytes of one fetched or read image


def _env_timeout() -> float:
    return float(os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", "5"))


def _env_redirects() -> bool:
    return os.environ.get("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "1").strip().lower() not in (
        "0",
        "false",
        "no",
    )


class MediaConnector:
    def __init__(
        self,
        allowed_local_media_path: str | os.PathLike | None = None,
        allowed_media_domains: Iterable[str] | None = None,
        *,
        fetch_timeout: float | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        allow_redirects: bool | None = None,
    ) -> None:
        self.local_dir = None
        if allowed_local_media_path:
            d = os.path.realpath(allowed_local_media_path)
            if not os.path.isdir(d):
                raise ValueError(
                    f"--allowed-local-media-path: {allowed_local_media_path!r} is not a directory"
                )
            self.local_dir = d
        domains = [d.strip().lower() for d in allowed_media_domains or () if d.strip()]
        self.domains = frozenset(domains) or None  # None: any host
        self.timeout = _env_timeout() if fetch_timeout is None else float(fetch_timeout)
        if self.timeout <= 0 or max_bytes <= 0:
            raise ValueError("the image fetch timeout and byte limit must be > 0")
        self.max_bytes = int(max_bytes)
        self.allow_redirects = _env_redirects() if allow_redirects is None else allow_redirects

    @staticmethod
    def is_url(obj: object) -> bool:
        """A `file://` / `http(s)://` URL string (what `get` reads)."""
        return isinstance(obj, str) and obj.split(":", 1)[0].lower() in ("file", "http", "https")

    def get(self, url: str, field: str) -> bytes:
        """The encoded image at `url` (ImageError naming `field`)."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "file":
            return self._read_file(url, field)
        if scheme in ("http", "https"):
            return self._fetch(url, field)
        raise ImageError(
            f"{field}: unsupported image URL (got {scheme or 'a path'}); use a data: URL, an "
            f"http(s):// URL or a file:// URL under --allowed-local-media-path",
            field,
        )

    def _read_file(self, url: str, field: str) -> bytes:
        if self.local_dir is None:
            raise ImageError(
                f"{field}: file:// URLs are refused: the server was started without "
                f"--allowed-local-media-path",
                field,
            )
        parts = urllib.parse.urlparse(url)
        if parts.netloc not in ("", "localhost"):
            raise ImageError(
                f"{field}: a file:// URL must name no host (got {parts.netloc!r})", field
            )
        path = os.path.realpath(urllib.parse.unquote(parts.path))
        if os.path.commonpath([path, self.local_dir]) != self.local_dir:
            raise ImageError(f"{field}: the file is outside --allowed-local-media-path", field)
        try:
            with open(path, "rb") as f:
                data = f.read(self.max_bytes + 1)
        except OSError as e:
            raise ImageError(f"{field}: cannot read the file ({e.strerror})", field) from None
        if len(data) > self.max_bytes:
            raise self._too_large(field)
        return data

    def _too_large(self, field: str) -> ImageError:
        return ImageError(
            f"{field}: the image is larger than {self.max_bytes} bytes (--max-image-bytes)", field
        )

    def check_host(self, url: str, field: str) -> None:
        """ImageError unless `url`'s host is allowed (`--allowed-media-domains`)."""
        host = (urllib.parse.urlparse(url).hostname or "").lower()
        if self.domains is not None and host not in self.domains:
            raise ImageError(f"{field}: the host {host!r} is not in --allowed-media-domains", field)

    def _fetch(self, url: str, field: str) -> bytes:
        self.check_host(url, field)
        opener = urllib.request.build_opener(_Redirects(self, field))
        deadline = time.monotonic() + self.timeout
        chunks, size = [], 0
        try:
            with opener.open(url, timeout=self.timeout) as resp:
                while True:
                    if time.monotonic() > deadline:
                        raise TimeoutError
                    chunk = resp.read(1 << 16)
                    if not chunk:
                        break
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise self._too_large(field)
                    chunks.append(chunk)
        except urllib.error.HTTPError as e:
            raise ImageError(f"{field}: fetching the image gave HTTP {e.code}", field) from None
        except (TimeoutError, OSError) as e:
            if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", 0), TimeoutError):
                raise ImageError(
                    f"{field}: fetching the image timed out after {self.timeout:g} s "
                    f"(VLLM_IMAGE_FETCH_TIMEOUT)",
                    field,
                ) from None
            why = getattr(e, "reason", e)
            raise ImageError(f"{field}: fetching the image failed ({why})", field) from None
        return b"".join(chunks)


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Each redirect hop checked as the first URL was (or refused: VLLM_MEDIA_URL_ALLOW_REDIRECTS=0)."""

    def __init__(self, media: MediaConnector, field: str) -> None:
        self.media, self.field = media, field

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        if not self.media.allow_redirects:
            raise ImageError(
                f"{self.field}: the image URL redirects (VLLM_MEDIA_URL_ALLOW_REDIRECTS=0)",
                self.field,
            )
        if urllib.parse.urlparse(newurl).scheme.lower() not in ("http", "https"):
            raise ImageError(f"{self.field}: the image URL redirects off http(s)", self.field)
        self.media.check_host(newurl, self.field)
        return super().redirect_request(req, fp, code, msg, headers, newurl)
