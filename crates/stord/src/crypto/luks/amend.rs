//! Key slot changes (QEMU's qcrypto_block_luks_amend_options): a slot made active for a
//! new password, or slots erased by index or by the password they hold, with QEMU's checks,
//! texts and order of writes. Nothing is written here: the change comes back as the writes
//! to make, in order (a new slot's material before the header that makes it active; an
//! erased slot's header before its material is overwritten with random bytes), and the
//! header in memory is the new one.

use zeroize::Zeroizing;

use super::header::NUM_KEY_SLOTS;
use super::{Luks, ReadFn};
use crate::crypto::CryptoError;

/// QEMU's default PBKDF2 time for a new slot, in milliseconds.
const DEFAULT_ITER_TIME_MS: u64 = super::create::DEFAULT_ITER_TIME_MS;
/// How often an erased slot's material is overwritten (QEMU's ERASE_ITERATIONS).
pub const ERASE_ITERATIONS: usize = 40;

/// A secret's password by id, or QEMU's error for it ("No secret with id ...").
pub type LookupFn<'a> = &'a dyn Fn(&str) -> Result<Zeroizing<Vec<u8>>, CryptoError>;

/// QEMU's QCryptoBlockAmendOptionsLUKS.
#[derive(Debug, Clone, Default)]
pub struct KeyslotChange {
    /// `state=active` (add a slot) or `inactive` (erase slots).
    pub active: bool,
    pub new_secret: Option<String>,
    pub old_secret: Option<String>,
    pub keyslot: Option<i64>,
    /// Milliseconds (QAPI's int, taken as QEMU's uint64_t takes it).
    pub iter_time: Option<i64>,
    /// The secret that unlocks the key for a new slot (else the one the volume opened with).
    pub secret: Option<String>,
}

/// One write of the change, at an offset of the header's storage.
pub enum HeaderWrite {
    Bytes(u64, Zeroizing<Vec<u8>>),
    /// `len` random bytes (an erased slot's material, written once per pass).
    Random(u64, usize),
}

/// Applies `change` to `luks` (`force`: QEMU's, which lets the last slot go or an active
/// one be overwritten); `opened_with` is the secret the volume was unlocked with. The
/// writes to make, in order.
pub fn amend(
    luks: &mut Luks,
    change: &KeyslotChange,
    force: bool,
    opened_with: &str,
    lookup: LookupFn<'_>,
    read: ReadFn<'_>,
) -> Result<Vec<HeaderWrite>, CryptoError> {
    if change.active {
        add_keyslot(luks, change, force, opened_with, lookup, read)
    } else {
        erase_keyslots(luks, change, force, lookup, read)
    }
}

fn invalid(s: impl Into<String>) -> CryptoError {
    CryptoError::Invalid(s.into())
}

/// QEMU's qcrypto_block_luks_amend_add_keyslot.
fn add_keyslot(
    luks: &mut Luks,
    c: &KeyslotChange,
    force: bool,
    opened_with: &str,
    lookup: LookupFn<'_>,
    read: ReadFn<'_>,
) -> Result<Vec<HeaderWrite>, CryptoError> {
    let iter_time = c.iter_time.map_or(DEFAULT_ITER_TIME_MS, |t| t as u64);
    let Some(new_secret) = &c.new_secret else {
        return Err(invalid("'new-secret' is required to activate a keyslot"));
    };
    if c.old_secret.is_some() {
        return Err(invalid(
            "'old-secret' must not be given when activating keyslots",
        ));
    }
    let slot = match c.keyslot {
        Some(k) => {
            // QEMU keeps the number in an int and prints it unsigned.
            let k = k as i32;
            if !(0..NUM_KEY_SLOTS as i32).contains(&k) {
                return Err(invalid(format!(
                    "Invalid keyslot {} specified, must be between 0 and {}",
                    k as u32,
                    NUM_KEY_SLOTS - 1
                )));
            }
            k as usize
        }
        None => (0..NUM_KEY_SLOTS)
            .find(|&i| !luks.slot_active(i))
            .ok_or_else(|| invalid("Can't add a keyslot - all keyslots are in use"))?,
    };
    if !force && luks.slot_active(slot) {
        return Err(invalid(format!(
            "Refusing to overwrite active keyslot {slot} - please erase it first"
        )));
    }
    let old = lookup(c.secret.as_deref().unwrap_or(opened_with))?;
    let key = luks.find_key(&old, read)?;
    let new = lookup(new_secret)?;
    let (header, material) = luks.make_slot(slot, &new, &key, iter_time)?;
    let (offset, _) = luks.material(slot);
    luks.header.key_slots[slot] = header;
    Ok(vec![
        HeaderWrite::Bytes(offset, material),
        header_write(luks),
    ])
}

fn header_write(luks: &Luks) -> HeaderWrite {
    HeaderWrite::Bytes(0, Zeroizing::new(luks.header.encode().to_vec()))
}

/// QEMU's qcrypto_block_luks_amend_erase_keyslots.
fn erase_keyslots(
    luks: &mut Luks,
    c: &KeyslotChange,
    force: bool,
    lookup: LookupFn<'_>,
    read: ReadFn<'_>,
) -> Result<Vec<HeaderWrite>, CryptoError> {
    for (given, what) in [
        (c.new_secret.is_some(), "new-secret"),
        (c.iter_time.is_some(), "iter-time"),
        (c.secret.is_some(), "secret"),
    ] {
        if given {
            return Err(invalid(format!(
                "'{what}' must not be given when erasing keyslots"
            )));
        }
    }
    let old = c.old_secret.as_deref().map(lookup).transpose()?;
    let slots = match (c.keyslot, &old) {
        (Some(k), old) => {
            let old = old.as_ref().map(|p| &p[..]);
            vec![erasable_slot(luks, k as i32, old, force, read)?]
        }
        (None, Some(old)) => slots_of_password(luks, old, force, read)?,
        (None, None) => {
            return Err(invalid(
                "To erase keyslot(s), either explicit keyslot index or the password \
                 currently contained in them must be given",
            ))
        }
    };
    let mut writes = Vec::new();
    for i in slots {
        luks.erase_slot(i);
        writes.push(header_write(luks));
        let (offset, len) = luks.material(i);
        writes.extend((0..ERASE_ITERATIONS).map(|_| HeaderWrite::Random(offset, len)));
    }
    Ok(writes)
}

/// Slot `k`, checked as QEMU checks an explicitly given slot before erasing it.
fn erasable_slot(
    luks: &Luks,
    k: i32,
    old: Option<&[u8]>,
    force: bool,
    read: ReadFn<'_>,
) -> Result<usize, CryptoError> {
    if !(0..NUM_KEY_SLOTS as i32).contains(&k) {
        return Err(invalid(format!(
            "Invalid keyslot {k} specified, must be between 0 and {}",
            NUM_KEY_SLOTS - 1
        )));
    }
    let i = k as usize;
    if let Some(old) = old {
        if luks.load_key(i, old, read)?.is_none() {
            return Err(invalid(format!(
                "Given keyslot {i} doesn't contain the given old password for erase operation"
            )));
        }
    }
    if !force && !luks.slot_active(i) {
        // QEMU's text ends with a space.
        return Err(invalid(format!(
            "Given keyslot {i} is already erased (inactive) "
        )));
    }
    if !force && luks.active_slots() == 1 {
        return Err(invalid(format!(
            "Attempt to erase the only active keyslot {i} which will erase all the data \
             in the image irreversibly - refusing operation"
        )));
    }
    Ok(i)
}

/// Every slot `old` opens, unless that is every active slot (and not `force`).
fn slots_of_password(
    luks: &Luks,
    old: &[u8],
    force: bool,
    read: ReadFn<'_>,
) -> Result<Vec<usize>, CryptoError> {
    let mut slots = Vec::new();
    for i in 0..NUM_KEY_SLOTS {
        if luks.load_key(i, old, read)?.is_some() {
            slots.push(i);
        }
    }
    if slots.is_empty() {
        return Err(invalid(
            "No keyslots match given (old) password for erase operation",
        ));
    }
    if !force && slots.len() == luks.active_slots() {
        return Err(invalid(
            "All the active keyslots match the (old) password that was given and erasing \
             them will erase all the data in the image irreversibly - refusing operation",
        ));
    }
    Ok(slots)
}

#[cfg(test)]
mod tests {
    use super::super::create::{create, CreateOptions};
    use super::super::header::HEADER_LEN;
    use super::*;

    /// A volume in memory for `pw`, its slots cheap to make.
    fn volume(pw: &[u8]) -> (Vec<u8>, Luks) {
        let o = CreateOptions {
            iter_time_ms: 1,
            ..Default::default()
        };
        let c = create(&o, pw, false).unwrap();
        let mut disk = vec![0u8; c.luks.payload_offset() as usize];
        let (off, len) = c.luks.material(0);
        disk[off as usize..off as usize + len].copy_from_slice(&c.material);
        disk[..HEADER_LEN].copy_from_slice(&c.luks.header.encode());
        (disk, c.luks)
    }

    fn apply(disk: &mut [u8], writes: Vec<HeaderWrite>) {
        for w in writes {
            match w {
                HeaderWrite::Bytes(off, b) => {
                    disk[off as usize..off as usize + b.len()].copy_from_slice(&b)
                }
                HeaderWrite::Random(off, len) => {
                    crate::crypto::random_bytes(&mut disk[off as usize..off as usize + len])
                        .unwrap()
                }
            }
        }
    }

    fn secrets(id: &str) -> Result<Zeroizing<Vec<u8>>, CryptoError> {
        match id {
            "a" | "b" | "c" => Ok(Zeroizing::new(format!("pw-{id}").into_bytes())),
            _ => Err(invalid(format!("No secret with id '{id}'"))),
        }
    }

    /// Runs `change` on the volume; the error text, or the volume as written.
    fn run(disk: &mut [u8], luks: &mut Luks, change: KeyslotChange, force: bool) -> String {
        let snapshot = disk.to_vec();
        let mut read = |off: u64, b: &mut [u8]| {
            b.copy_from_slice(&snapshot[off as usize..off as usize + b.len()]);
            Ok(())
        };
        match amend(luks, &change, force, "a", &secrets, &mut read) {
            Ok(w) => {
                apply(disk, w);
                String::new()
            }
            Err(e) => e.to_string(),
        }
    }

    fn opens(disk: &[u8], pw: &[u8]) -> bool {
        let luks = Luks::load(disk[..HEADER_LEN].try_into().unwrap(), false).unwrap();
        let mut read = |off: u64, b: &mut [u8]| {
            b.copy_from_slice(&disk[off as usize..off as usize + b.len()]);
            Ok(())
        };
        luks.find_key(pw, &mut read).is_ok()
    }

    fn add(new: &str) -> KeyslotChange {
        KeyslotChange {
            active: true,
            new_secret: Some(new.into()),
            iter_time: Some(1),
            ..Default::default()
        }
    }

    fn erase(old: Option<&str>, slot: Option<i64>) -> KeyslotChange {
        KeyslotChange {
            old_secret: old.map(str::to_string),
            keyslot: slot,
            ..Default::default()
        }
    }

    #[test]
    fn slots_are_added_and_erased_as_qemu_does() {
        let (mut disk, mut luks) = volume(b"pw-a");
        assert_eq!(run(&mut disk, &mut luks, add("b"), false), "");
        assert!(opens(&disk, b"pw-b") && opens(&disk, b"pw-a"));
        assert!(luks.slot_active(1));
        let e = run(&mut disk, &mut luks, erase(Some("c"), None), false);
        assert_eq!(
            e,
            "No keyslots match given (old) password for erase operation"
        );
        assert_eq!(run(&mut disk, &mut luks, erase(Some("a"), None), false), "");
        assert!(opens(&disk, b"pw-b") && !opens(&disk, b"pw-a"));
        // Slot 0's material is random now.
        let (off, len) = luks.material(0);
        assert!(disk[off as usize..off as usize + len]
            .iter()
            .any(|&b| b != 0));
        let e = run(&mut disk, &mut luks, erase(None, Some(1)), false);
        assert!(
            e.starts_with("Attempt to erase the only active keyslot 1"),
            "{e}"
        );
        let e = run(&mut disk, &mut luks, erase(None, Some(0)), false);
        assert_eq!(e, "Given keyslot 0 is already erased (inactive) ");
        let e = run(&mut disk, &mut luks, erase(Some("b"), None), false);
        assert!(e.starts_with("All the active keyslots match"), "{e}");
        // The volume opened with "a", which opens nothing now: `secret` names another.
        let e = run(&mut disk, &mut luks, add("c"), false);
        assert_eq!(e, "Invalid password, cannot unlock any keyslot");
        let mut c = add("c");
        c.secret = Some("b".into());
        c.keyslot = Some(1);
        let e = run(&mut disk, &mut luks, c.clone(), false);
        assert_eq!(
            e,
            "Refusing to overwrite active keyslot 1 - please erase it first"
        );
        assert_eq!(run(&mut disk, &mut luks, c, true), "");
        assert!(opens(&disk, b"pw-c") && !opens(&disk, b"pw-b"));
    }

    #[test]
    fn options_are_checked_with_qemus_words() {
        let (mut disk, mut luks) = volume(b"pw-a");
        let mut c = add("b");
        c.keyslot = Some(-1);
        let e = run(&mut disk, &mut luks, c, false);
        assert_eq!(
            e,
            "Invalid keyslot 4294967295 specified, must be between 0 and 7"
        );
        let e = run(&mut disk, &mut luks, erase(None, Some(8)), false);
        assert_eq!(e, "Invalid keyslot 8 specified, must be between 0 and 7");
        let e = run(&mut disk, &mut luks, add("nope"), false);
        assert_eq!(e, "No secret with id 'nope'");
        let mut c = add("b");
        c.old_secret = Some("a".into());
        let e = run(&mut disk, &mut luks, c, false);
        assert_eq!(e, "'old-secret' must not be given when activating keyslots");
        let mut c = erase(Some("a"), None);
        c.iter_time = Some(10);
        let e = run(&mut disk, &mut luks, c, false);
        assert_eq!(e, "'iter-time' must not be given when erasing keyslots");
        let e = run(&mut disk, &mut luks, erase(None, None), false);
        assert!(e.starts_with("To erase keyslot(s), either"), "{e}");
        let e = run(
            &mut disk,
            &mut luks,
            KeyslotChange {
                active: true,
                ..Default::default()
            },
            false,
        );
        assert_eq!(e, "'new-secret' is required to activate a keyslot");
        // Nothing changed: the volume still opens with its only password.
        assert!(opens(&disk, b"pw-a"));
        assert_eq!(luks.active_slots(), 1);
    }
}
