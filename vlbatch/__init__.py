"""vlbatch: folders of PDFs and images -> Parquet tables of vision-language-model answers."""

__version__ = "0.1.0"
