"""DeepSpeed class names that shardspeed answers without having such a class.

DeepSpeed builds a different class for each feature (`PipelineEngine`, `DeepSpeedHybridEngine`,
`DeepSpeedZeroOptimizer`, ...); shardspeed builds one object and composes the feature into it.
Libraries and scripts still test `isinstance(x, DeepSpeedName)`, so such a name is a class whose
metaclass is `InstanceView`: `isinstance` asks the class's `describes(instance)`, and calling the
name fails with `built_by`, which says how to get such an object.
"""

from __future__ import annotations

from typing import Any


class InstanceView(type):
    """Metaclass of a DeepSpeed class name that describes some of shardspeed's objects.

    A class (or a metaclass deriving from this one) defines `describes(instance) -> bool` and
    `built_by`, a sentence saying what makes the object instead of the class's constructor."""

    built_by = "shardspeed builds it in initialize()"

    def describes(cls, instance: object) -> bool:
        raise NotImplementedError(f"{cls.__name__} must define describes(instance)")

    def __instancecheck__(cls, instance: object) -> bool:
        return bool(cls.describes(instance))

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{cls.__name__} is DeepSpeed's name for an object that {cls.built_by}")
