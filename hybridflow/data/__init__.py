"""Data: synthetic tasks and row-file (parquet / JSONL) reading."""

from hybridflow.data.arithmetic import ArithmeticSpec, first_operand_below, make_arithmetic_rows, make_arithmetic_split
from hybridflow.data.rows import read_rows, write_rows

__all__ = ["ArithmeticSpec", "first_operand_below", "make_arithmetic_rows", "make_arithmetic_split", "read_rows", "write_rows"]
