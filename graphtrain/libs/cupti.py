"""CUPTI through NVIDIA's cupti-python (the `profile` extra): each call checked, by name."""

from graphtrain.libs.shared_lib import LibraryError


def call(name: str, *args):
    """cupti.<name>(*args); a failing status raises LibraryError naming the call and the status."""
    from cupti import cupti  # ImportError without the profile extra (graphtrain.profile checks first)

    try:
        return getattr(cupti, name)(*args)
    except cupti.cuptiError as exc:
        raise LibraryError(f"cupti.{name}", exc.status, cupti.Result(exc.status).name) from exc
