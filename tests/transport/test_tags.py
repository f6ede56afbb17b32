"""Every reserved tag lives in meshkit.transport.tags: distinct, in range, refused where it must be."""

from __future__ import annotations

import pytest

from meshkit import wire
from meshkit.transport import tags

KERNEL_TAGS = {name: getattr(tags, name) for name in tags.__all__ if name.startswith("TAG_")
               and name != "TAG_MAX"}


def test_every_tag_the_kernel_sends_has_its_own_value() -> None:
    # TAG_JOB is the one alias: a job is a control message.
    assert tags.TAG_JOB == tags.TAG_CONTROL
    values = [value for name, value in KERNEL_TAGS.items() if name != "TAG_JOB"]
    assert len(values) == len(set(values)), KERNEL_TAGS


def test_the_values_the_protocols_were_written_against_are_kept() -> None:
    assert (tags.TAG_WELCOME, tags.TAG_REDUCE, tags.TAG_SCATTER, tags.TAG_BYE) == (
        0xFFFF0000, 0xFFFF0001, 0xFFFF0002, 0xFFFF0003)
    assert (tags.TAG_CAPS, tags.TAG_CONTROL, tags.TAG_UP, tags.TAG_ACT, tags.TAG_ABORT) == (
        0xFFFF0010, 0xFFFF0011, 0xFFFF0012, 0xFFFF0013, 0xFFFF0014)
    assert (tags.TAG_REQUEST, tags.TAG_REPLY) == (0x6D6B_0101, 0x6D6B_0102)


def test_kernel_tags_are_reserved_except_the_trainers_which_use_the_public_api() -> None:
    for name, value in KERNEL_TAGS.items():
        assert 0 <= value <= tags.TAG_MAX
        reserved = value >= tags.RESERVED_TAGS
        assert reserved == (name not in {"TAG_REQUEST", "TAG_REPLY"}), name


def test_the_reserved_range_is_the_one_the_wire_codec_documents() -> None:
    assert tags.RESERVED_TAGS == wire.RESERVED_TAG_BASE


@pytest.mark.parametrize("tag", sorted(tags.SERVICE_TAGS))
def test_the_transports_own_tags_are_refused_to_send_but_not_to_the_service(tag) -> None:
    with pytest.raises(ValueError, match="the transport's own"):
        tags.check_tag(tag)
    assert tags.check_tag(tag, service=True) == tag


@pytest.mark.parametrize("tag", [tags.TAG_CAPS, tags.TAG_UP, tags.TAG_REQUEST, 0, tags.TAG_MAX])
def test_other_tags_may_be_sent(tag) -> None:
    assert tags.check_tag(tag) == tag


@pytest.mark.parametrize("tag", [-1, tags.TAG_MAX + 1, True, 1.0, "7"])
def test_a_tag_must_be_an_int_in_range(tag) -> None:
    with pytest.raises(ValueError, match="a tag must be an int"):
        tags.check_tag(tag)


def test_no_kernel_module_but_tags_py_defines_a_tag():
    import ast
    from pathlib import Path

    kernel = Path(__file__).resolve().parents[2] / "meshkit"
    found = []
    for path in sorted(kernel.rglob("*.py")):
        if path == kernel / "transport" / "tags.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, int):
                found += [f"{path.relative_to(kernel)}:{node.lineno} {t.id}" for t in node.targets
                          if isinstance(t, ast.Name) and t.id.startswith("TAG_")]
    assert found == [], "define tags in meshkit/transport/tags.py only: " + ", ".join(found)
