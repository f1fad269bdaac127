"""The package version (a bottom module, so every layer can read it without importing the
package itself)."""

__version__ = "0.1.0"
