"""All CPU-native code: the C sources, their build and loading (`native`), the few-row matmul
choice (`matmul`), the grouped int8 matmul (`int8g`), the native dense decode step (`decode`),
the cpu device's step executor (`executor`) and its decode mirror (`mirror`)."""
