"""The native step's C source (decode.c) and, once built, its library."""
