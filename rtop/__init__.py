"""rtop: top for distributed training — hub, analysis, report and terminal UI."""

__version__ = "0.1.0"
