//! The safetensors format: the header codec ([`header`] read by [`header_reader`] on the JSON tokenizer [`scan`]),
//! the memory budget a header is checked against ([`budget`]), the tree record that maps a
//! nested tree onto tensor names ([`tree_meta`], read by [`tree_census`] and
//! [`tree_decode`]), and the writer of both ([`header_writer`]).

pub(crate) mod budget;
pub(crate) mod header;
pub(crate) mod header_reader;
pub(crate) mod header_writer;
pub(crate) mod scan;
pub(crate) mod tree_census;
pub(crate) mod tree_decode;
pub(crate) mod tree_meta;
