"""Data: synthetic tasks and row-file (parquet / JSONL) reading."""

from hybridflow.data.arithmetic import ArithmeticSpec, make_arithmetic_rows
from hybridflow.data.rows import read_rows, write_rows

__all__ = ["ArithmeticSpec", "make_arithmetic_rows", "read_rows", "write_rows"]
