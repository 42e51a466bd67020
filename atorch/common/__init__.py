"""ATorch's ``atorch.common`` import paths, kept for scripts written against ATorch."""
