"""The package version, alone in a leaf module so that any layer may read it without importing the
package face."""

__version__ = "0.1.0"
