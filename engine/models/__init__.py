"""Model families, one file per GGUF `general.architecture`, each exporting ModelArgs and Model."""
