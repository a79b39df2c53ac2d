//! Reading safetensors files: validated headers, then zero-copy views of a memory map,
//! one read into fresh aligned memory, or parallel `O_DIRECT` reads ([`super::direct`]).
//! Only regular files are read, and a load never allocates more than [`super::budget`]
//! allows: four times the file's size plus 4 MiB.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use memmap2::{Mmap, MmapOptions};

use super::format::header::{Header, HeaderCensus};
use super::format::header_reader::{header_len, parse_counted, parse_header};
use super::format::tree_meta::TREE_METADATA_KEY;
use super::format::{budget, tree_census, tree_decode};
use super::fs::direct::{Reader, Window};
use super::fs::direct_runs::RunFile;
use super::fs::file_kind::open_regular;
use super::pool::{flat_dict, Pool};
use crate::error::{Error, Result};
use crate::memory::AlignedBuffer;
use crate::storage::Storage;
use crate::tree::{Node, TensorDict};

/// How to load.
///
/// ```
/// use tensorferry::LoadOptions;
///
/// // The default reads the file into fresh memory: safe whatever happens to the file.
/// let read = LoadOptions::default();
/// assert!(!read.mmap.is_mapped());
/// // Past the page cache, for a cold checkpoint read once.
/// let direct = LoadOptions { direct: true, ..Default::default() };
/// # let _ = direct;
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Read the file into fresh memory ([`Mapping::READ`], the default), or map it and
    /// hand out views of the map (cost proportional to the header): only through the
    /// `unsafe` [`Mapping::map`], whose `# Safety` section says what the caller promises.
    pub mmap: Mapping,
    /// Read the data with `O_DIRECT`, past the page cache, into fresh memory aligned to
    /// 4096 bytes, with several reads in flight. Default false. Takes precedence over
    /// `mmap` (a direct read is never a map).
    ///
    /// For files read once that are larger than the free page cache (a cold checkpoint):
    /// the page cache would only add a copy and evictions. Files read again soon, or
    /// already cached (warm), load faster through the cache: leave it off. Where the
    /// filesystem refuses `O_DIRECT` (or `TENSORFERRY_DIRECT_IO=0` is set), the data is
    /// read through the page cache and [`Loaded::direct_fallback`] says why.
    pub direct: bool,
    /// With a map, map the file privately and writable (copy-on-write, as NumPy's
    /// `mmap_mode="c"`): the tensors may be written — frameworks that need writable memory
    /// (PyTorch) share the map instead of copying it — and writes stay in this process,
    /// never reaching the file. Default false. Where the system refuses such a map (its
    /// commit limit counts the file's size), the file is mapped read-only instead.
    pub copy_on_write: bool,
}

/// Whether a load maps the file instead of reading it ([`LoadOptions::mmap`]). Safe code
/// gets only [`Mapping::READ`]; a map is asked for with the `unsafe` [`Mapping::map`], as
/// candle's memory-mapping loaders are `unsafe fn`s.
///
/// ```
/// use tensorferry::{LoadOptions, Mapping};
///
/// // SAFETY (of the example): the caller promises that nobody truncates or rewrites the
/// // file while its tensors are alive.
/// let options = LoadOptions { mmap: unsafe { Mapping::map() }, ..Default::default() };
/// assert!(options.mmap.is_mapped());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mapping {
    map: bool,
}

impl Mapping {
    /// Read the file into fresh memory: later changes to the file never reach the tensors.
    pub const READ: Mapping = Mapping { map: false };

    /// Map the file and let the tensors view the map instead of reading it.
    ///
    /// # Safety
    ///
    /// While any tensor of the load (or a view or clone of one) is alive, no program may
    /// truncate the file or write to it in place. As with every memory map, a truncated
    /// file makes a read of the missing pages raise `SIGBUS` (the process dies, no error
    /// is returned) and a rewritten one changes the tensors' bytes under safe references:
    /// undefined behaviour. Replacing the file by rename (as tensorferry's own saves do)
    /// leaves an existing map intact and is allowed.
    pub unsafe fn map() -> Mapping {
        Mapping { map: true }
    }

    /// True when the load maps the file.
    pub fn is_mapped(&self) -> bool {
        self.map
    }
}

/// What a file holds.
///
/// ```
/// use tensorferry::{load, save, LoadOptions, Node, SaveOptions, Tensor, TensorDict};
///
/// let dir = std::env::temp_dir().join(format!("tf-doc-loaded-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// let path = dir.join("m.safetensors");
/// let mut d = TensorDict::new();
/// d.insert("w", Tensor::from_slice(&[1u8], &[1])?);
/// let mut options = SaveOptions::default();
/// options.metadata.insert("author".into(), "me".into());
/// save(&Node::from(d), &path, &options)?;
/// let (dict, metadata) = load(&path, LoadOptions::default())?.into_dict()?;
/// assert_eq!((dict.len(), metadata["author"].as_str()), (1, "me"));
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Loaded {
    /// The tree as saved (or a flat dict of names for files tensorferry did not write).
    pub root: Node,
    /// The user metadata, without tensorferry's reserved key.
    pub metadata: BTreeMap<String, String>,
    /// Why a load asked to read directly ([`LoadOptions::direct`]) went through the page
    /// cache instead, e.g. "tmpfs refused O_DIRECT (EINVAL): read through the page
    /// cache"; `None` when it read directly or was not asked to.
    pub direct_fallback: Option<String>,
}

impl Loaded {
    /// The dictionary at the root with the user metadata, for files whose root is a
    /// dictionary (every file of other tools is); a list or tuple at the root is an
    /// [`Error::InvalidValue`].
    pub fn into_dict(self) -> Result<(TensorDict, BTreeMap<String, String>)> {
        match self.root {
            Node::Dict(d) => Ok((d, self.metadata)),
            _ => Err(Error::InvalidValue {
                key: String::new(),
                reason: "the file holds a list or tuple at its root, not a dictionary".into(),
            }),
        }
    }
}

/// Loads one safetensors file (never an index: shards are files).
pub(crate) fn load_file(path: &Path, options: LoadOptions) -> Result<Loaded> {
    load_one_file(path, options).map_err(|e| e.in_file(path))
}

fn load_one_file(path: &Path, options: LoadOptions) -> Result<Loaded> {
    let (mut file, file_len) = open_regular(path)?;
    if options.direct {
        return read_direct(file, path, file_len);
    }
    let (parsed, storage, base) = if options.mmap.is_mapped() {
        map_file(&file, path, file_len, options.copy_on_write)?
    } else {
        read_file(&mut file, path, file_len)?
    };
    build(parsed, storage, base)
}

/// Reads and validates only the header of the file at `path` (cost proportional to it).
/// Refuses what [`crate::load`] refuses, before reading anything from the file.
pub fn read_header(path: impl AsRef<Path>) -> Result<Header> {
    let path = path.as_ref();
    let (mut file, file_len) = open_regular(path)?;
    header_of(&mut file, path, file_len)
        .map(|(header, _)| header)
        .map_err(|e| e.in_file(path))
}

/// A header and what its census counted.
pub(super) type Parsed = (Header, HeaderCensus);

/// Reads and validates the header at the start of `file`, leaving the file positioned at
/// the data section ([`Header::data_start`]).
pub(super) fn header_of(file: &mut File, path: &Path, file_len: u64) -> Result<Parsed> {
    let header_bytes = read_header_bytes(file, path, file_len)?;
    parse_counted(&header_bytes, file_len - 8 - header_bytes.len() as u64)
}

/// The header's JSON bytes (its length checked against the file), the file left
/// positioned at the data section.
pub(super) fn read_header_bytes(file: &mut File, path: &Path, file_len: u64) -> Result<Vec<u8>> {
    // Read in order from the file's start: each read begins where the last one ended.
    header_json(file_len, |_, buf| {
        file.read_exact(buf).map_err(|e| Error::io("read", path, e))
    })
}

/// The header of the file open as `file`, read from that open file (never from its path,
/// which may name another file by now) and validated as [`read_header`] validates it.
pub fn read_run_file_header(file: &RunFile) -> Result<Header> {
    let file_len = file.len();
    header_json(file_len, |at, buf| file.read_into(&mut [(at, buf)], 1))
        .and_then(|json| parse_header(&json, file_len - 8 - json.len() as u64))
        .map_err(|e| e.in_file(file.path()))
}

/// The header's JSON bytes of a file of `file_len` bytes, its length checked against the
/// file: `read(at, buf)` fills `buf` with the file's bytes from `at` (the length's 8
/// bytes at 0, then the JSON at 8).
fn header_json(
    file_len: u64,
    mut read: impl FnMut(u64, &mut [u8]) -> Result<()>,
) -> Result<Vec<u8>> {
    let mut prefix = [0u8; 8];
    if file_len >= 8 {
        read(0, &mut prefix)?;
    }
    let n = header_len(&prefix, file_len)?;
    let mut json = vec![0u8; n as usize];
    read(8, &mut json)?;
    Ok(json)
}

/// Loads from bytes in memory (copied into aligned memory first); the same validation
/// as files. For data that never touched a disk, and for fuzzing the reader.
pub fn load_bytes(bytes: &[u8]) -> Result<Loaded> {
    let parsed = parse_within(bytes)?;
    let data = AlignedBuffer::copy_from(&bytes[parsed.0.data_start as usize..])?;
    build(parsed, Arc::new(Storage::owned(data)), 0)
}

/// Reads and validates the header at the start of `bytes`, a whole file in memory.
fn parse_within(bytes: &[u8]) -> Result<Parsed> {
    let data_start = 8 + header_len(bytes, bytes.len() as u64)? as usize;
    parse_counted(&bytes[8..data_start], (bytes.len() - data_start) as u64)
}

/// Maps the file; tensors view the map at `data_start + begin`.
fn map_file(
    file: &File,
    path: &Path,
    file_len: u64,
    copy_on_write: bool,
) -> Result<(Parsed, Arc<Storage>, usize)> {
    if file_len < 8 {
        header_len(&[], file_len)?;
    }
    let private = copy_on_write
        .then(|| {
            // SAFETY: a map is made only when the caller asked for one through the unsafe
            // `Mapping::map`, promising that nobody truncates or rewrites the file while
            // it is mapped (tensorferry's own writes replace files by rename, which leaves
            // an existing map valid); being private, its writes go to this process's own
            // copies of the pages, never to the file.
            unsafe { MmapOptions::new().map_copy(file) }.ok()
        })
        .flatten();
    let storage = match private {
        Some(map) => Storage::mapped_copy_on_write(map),
        // SAFETY: read-only; the same assumption about the file as above.
        None => Storage::mapped(unsafe { Mmap::map(file) }.map_err(|e| Error::io("map", path, e))?),
    };
    let map = storage.host_bytes().expect("a map is host memory, filled");
    let parsed = parse_within(map)?;
    let data_start = parsed.0.data_start as usize;
    Ok((parsed, Arc::new(storage), data_start))
}

/// Headers from this size on are parsed while another thread reads the data section.
const OVERLAP_HEADER_BYTES: usize = 64 << 10;

/// Reads the header, then the data section in one read into aligned memory; a large
/// header (many tensors) is parsed while another thread reads the data, so the load
/// takes about the longer of the two rather than their sum. The data buffer is at most
/// the file's size, which the memory budget counts in any case; a header refused still
/// fails the load, with its own error.
fn read_file(file: &mut File, path: &Path, file_len: u64) -> Result<(Parsed, Arc<Storage>, usize)> {
    let header = read_header_bytes(file, path, file_len)?;
    let data_len = file_len - 8 - header.len() as u64;
    let mut data = AlignedBuffer::zeroed(data_len as usize)?;
    let read_err = |e| Error::io("read", path, e);
    let parsed = if header.len() < OVERLAP_HEADER_BYTES {
        let parsed = parse_counted(&header, data_len)?;
        file.read_exact(data.as_mut_slice()).map_err(read_err)?;
        parsed
    } else {
        let buffer = data.as_mut_slice();
        let (parsed, read) = std::thread::scope(|scope| {
            let reader = scope.spawn(move || file.read_exact(buffer));
            let parsed = parse_counted(&header, data_len);
            let read = reader
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the reading thread panicked")));
            (parsed, read)
        });
        let parsed = parsed?;
        read.map_err(read_err)?;
        parsed
    };
    Ok((parsed, Arc::new(Storage::owned(data)), 0))
}

/// Reads the header, then the data section with `O_DIRECT` into fresh page-aligned memory:
/// the aligned window of the file that covers it, the tensors viewing it at their offsets.
/// The window is at most 8 KiB more than the data; where that would take the load over its
/// memory budget, or the filesystem refuses `O_DIRECT`, the data is read through the page
/// cache and the load says why.
fn read_direct(mut file: File, path: &Path, file_len: u64) -> Result<Loaded> {
    let parsed = header_of(&mut file, path, file_len)?;
    let data_start = parsed.0.data_start;
    let data_len = file_len - data_start;
    if data_len == 0 {
        let empty = Arc::new(Storage::owned(AlignedBuffer::zeroed(0)?));
        return build(parsed, empty, 0);
    }
    let window = Window::covering(data_start, file_len);
    let widened =
        (window.len as u64 - data_len).saturating_add(budget::load_cost(&parsed.1, data_len));
    if widened > budget::allowed(file_len) {
        let mut reader = Reader::new(file, path, file_len, false);
        let mut data = AlignedBuffer::zeroed(data_len as usize)?;
        reader.read_into(data.as_mut_slice(), data_start)?;
        let mut loaded = build(parsed, Arc::new(Storage::owned(data)), 0)?;
        loaded.direct_fallback = Some(
            "reading whole 4096-byte blocks would take the load over its memory budget: \
             read through the page cache"
                .into(),
        );
        return Ok(loaded);
    }
    let mut reader = Reader::new(file, path, file_len, true);
    let mut data = AlignedBuffer::zeroed_page_aligned(window.len)?;
    reader.read_into(data.as_mut_slice(), window.start)?;
    let mut loaded = build(parsed, Arc::new(Storage::owned(data)), window.skip)?;
    loaded.direct_fallback = reader.fallback().map(String::from);
    Ok(loaded)
}

/// The tree: the recorded one, or a flat dict of the tensors in header order.
pub(super) fn build(
    (header, census): Parsed,
    storage: Arc<Storage>,
    base: usize,
) -> Result<Loaded> {
    let mut metadata = header.metadata;
    let root = match metadata.remove(TREE_METADATA_KEY) {
        None => Node::Dict(flat_dict(header.tensors, &storage, base)?),
        Some(text) => {
            let tree = match census.tree {
                Some(counted) => counted?,
                None => tree_census::count(&text)?,
            };
            let mut pool = Pool::new(header.tensors, storage, base);
            let root = tree_decode::decode(&text, &tree, &mut pool)?;
            pool.check_all_taken()?;
            root
        }
    };
    Ok(Loaded {
        root,
        metadata,
        direct_fallback: None,
    })
}
