"""What a run shows and records: console table, progress bars, metrics.jsonl, TensorBoard, config.json."""

from tlt_jax.metrics.progress import Progress
from tlt_jax.metrics.writers import COLUMNS, ConsoleTable, MetricsWriter, read_metrics

__all__ = ["COLUMNS", "ConsoleTable", "MetricsWriter", "Progress", "read_metrics"]
