"""Small DSL glue: device-side state objects that can live across dynamic control flow."""

import copy

import cutlass

# Config dtype names (flash4.constants.DTYPES) -> DSL element types: the one map on the device side.
DSL_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


class DynamicState:
    """Mixin for a plain class holding device values (registers tensors, scalars) that the DSL must
    carry through a dynamic `if`/loop. `_dynamic_fields` names the attributes that hold device
    values; every other attribute is a trace-time constant copied as is."""

    _dynamic_fields: tuple = ()

    def __extract_mlir_values__(self):
        values, self._values_pos = [], []
        for name in self._dynamic_fields:
            field_values = cutlass.extract_mlir_values(getattr(self, name))
            values += field_values
            self._values_pos.append(len(field_values))
        return values

    def __new_from_mlir_values__(self, values):
        new = copy.copy(self)
        for name, n in zip(self._dynamic_fields, self._values_pos):
            setattr(new, name, cutlass.new_from_mlir_values(getattr(self, name), values[:n]))
            values = values[n:]
        return new
