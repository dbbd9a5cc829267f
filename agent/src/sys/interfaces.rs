//! Network interfaces of the calling thread's namespace, by name and index.

use std::ffi::{CStr, CString};

/// The index of interface `name`, if it exists.
pub fn index(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    // SAFETY: c is a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (i != 0).then_some(i)
}

/// The name of interface `ifindex`, if it exists.
pub fn name(ifindex: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf has IF_NAMESIZE bytes, as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: on success buf holds a NUL-terminated name.
    let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Some(name.to_string_lossy().into_owned())
}

/// All interfaces, as (index, name).
pub fn all() -> Vec<(u32, String)> {
    let mut out = Vec::new();
    // SAFETY: if_nameindex returns an array terminated by a zero entry, freed below.
    unsafe {
        let list = libc::if_nameindex();
        if list.is_null() {
            return out;
        }
        let mut p = list;
        while (*p).if_index != 0 {
            let name = CStr::from_ptr((*p).if_name);
            out.push(((*p).if_index, name.to_string_lossy().into_owned()));
            p = p.add(1);
        }
        libc::if_freenameindex(list);
    }
    out
}
