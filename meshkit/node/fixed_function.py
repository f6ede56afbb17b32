"""Descriptors for pre-synthesized, fixed-function hardware (FPGA stages)."""

from __future__ import annotations

from typing import Any

import attrs

from meshkit.errors import PlacementError

__all__ = ["FixedFunction"]

_DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8", "int16", "int32")


@attrs.frozen
class FixedFunction:
    """A stage baked into hardware that cannot be reprogrammed at run time.

    An FPGA bitstream implements exactly one datapath and synthesis takes
    minutes, so a board cannot be shipped a graph: it advertises this
    descriptor and the coordinator only ever assigns it the matching stage.
    Activations cross the wire as float32; ``dtype`` is what the datapath was
    synthesized for, and the board's host driver converts.
    """

    stage_id: str = attrs.field(validator=attrs.validators.instance_of(str))
    input_elems: int = attrs.field(validator=[attrs.validators.instance_of(int),
                                              attrs.validators.gt(0)])
    output_elems: int = attrs.field(validator=[attrs.validators.instance_of(int),
                                               attrs.validators.gt(0)])
    dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(_DTYPES))

    @stage_id.validator
    def _stage_id_not_empty(self, attribute: Any, value: str) -> None:
        if not value:
            raise ValueError("FixedFunction.stage_id must not be empty")

    def check(self, stage: Any) -> None:
        """Raise :class:`PlacementError` unless this hardware can run ``stage``.

        ``stage`` is anything with a ``stage_id`` attribute (or a stage id
        string). Checked by the coordinator before shipping, so a mismatch is
        a clear error at placement time, not a hang or a wrong number later.
        """
        stage_id = stage if isinstance(stage, str) or stage is None else getattr(
            stage, "stage_id", None)
        if stage_id is None:
            raise PlacementError(
                f"fixed-function rank implements stage [{self.stage_id}], but the "
                f"stage it was offered carries no stage_id: set stage_id on the "
                f"stage to target pre-synthesized hardware")
        if stage_id != self.stage_id:
            raise PlacementError(
                f"fixed-function rank implements stage [{self.stage_id}], cannot run "
                f"[{stage_id}]: an FPGA datapath is synthesized, not compiled")

    def accepts(self, stage: Any) -> bool:
        """Whether :meth:`check` passes for ``stage``."""
        try:
            self.check(stage)
        except PlacementError:
            return False
        return True

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> FixedFunction:
        from meshkit.options import structure_strict

        return structure_strict(data, cls, where="fixed_function")
