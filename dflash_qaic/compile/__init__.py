"""QPC compilation for AI100: specializations, custom IO, compiler command line, cache."""
