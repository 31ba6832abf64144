//! RM clients and their handle trees, UVM ranges, and the allocations they keep alive:
//! RM_FREE of a handle frees its subtree, of a client handle the whole client; RM_DUP_OBJECT adds
//! a handle to the same memory, which lives until its last handle goes.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::{AllocId, Allocation, FailedAllocation, FileId, FreedBy, Model};
use crate::event::{Alloc, Device, Memory, Record};

#[derive(Clone, Debug)]
pub(super) struct Object {
    pub(super) parent: u32,
    /// The allocation whose memory this handle refers to (several handles after a dup).
    pub(super) alloc: Option<AllocId>,
    /// The GPU it belongs to: a device's own, inherited by everything below it.
    pub(super) gpu: Option<u32>,
    /// Its RM class, as allocated or as its dup's source ([`UNKNOWN_CLASS`] when that was not seen).
    pub(super) class: u32,
}

/// The class of a dup whose source was never seen: no class RM has (0 would read as a client).
pub(super) const UNKNOWN_CLASS: u32 = u32::MAX;

/// An attachment point named by a subdevice handle whose GPU is not known: above every GPU index.
pub(super) const HANDLE_POINT: u64 = 1 << 32;

#[derive(Clone, Debug, Default)]
pub(super) struct Client {
    pub(super) file: Option<FileId>,
    /// The process that made it (RM's ProcID, what the default share policy compares); None
    /// for a client made before tracing, whose shares were not seen either.
    pub(super) pid: Option<u32>,
    /// Its handles shared beyond that process (RM_SHARE), by share type (a revoke takes back
    /// one type only); a share of a handle covers what is below it (RM walks up to the first
    /// list it finds), of the client all of it.
    /// Ordered: a handle's shares are a range, found and removed without a scan of every share
    /// (freeing a subtree of N shared handles scanned them all N times).
    pub(super) shared: BTreeSet<(u32, u16)>,
    pub(super) objects: HashMap<u32, Object>,
    /// Parent handle to child handles, so freeing a subtree never scans the whole client.
    pub(super) children: HashMap<u32, HashSet<u32>>,
}

impl Client {
    pub(super) fn new(file: Option<FileId>, pid: Option<u32>) -> Self {
        Client { file, pid, ..Default::default() }
    }

    fn insert(&mut self, handle: u32, object: Object) {
        let parent = object.parent;
        if let Some(old) = self.objects.insert(handle, object) {
            if let Some(siblings) = self.children.get_mut(&old.parent) {
                siblings.remove(&handle);
            }
        }
        self.children.entry(parent).or_default().insert(handle);
    }

    /// The shares of `handle`, of every type.
    fn shares_of(&self, handle: u32) -> impl Iterator<Item = (u32, u16)> + '_ {
        self.shared.range((handle, 0)..=(handle, u16::MAX)).copied()
    }

    /// Removes `handle` and everything below it (and their shares); returns them with the
    /// handle itself first.
    fn remove_subtree(&mut self, handle: u32) -> Vec<(u32, Object)> {
        let mut removed = Vec::new();
        let mut stack = vec![handle];
        while let Some(h) = stack.pop() {
            let shares: Vec<(u32, u16)> = self.shares_of(h).collect();
            for share in shares {
                self.shared.remove(&share);
            }
            if let Some(kids) = self.children.remove(&h) {
                stack.extend(kids);
            }
            if let Some(o) = self.objects.remove(&h) {
                if let Some(siblings) = self.children.get_mut(&o.parent) {
                    siblings.remove(&h);
                }
                removed.push((h, o));
            }
        }
        removed
    }
}

impl Model {
    pub(super) fn on_object(
        &mut self,
        pid: u32,
        ts: u64,
        fd: i32,
        (client, parent, object): (u32, u32, u32),
        class: u32,
        gpu: Option<u32>,
    ) {
        if crate::abi::class::is_client(class) {
            // RM's client belongs to the file the call acts as (a registered device file's
            // nvidiactl file): released with it, reached through it.
            let file = self.file_of(pid, fd, ts).map(|f| self.acting(f));
            // RM never hands out a live handle twice: an old client by that handle was freed in
            // a way the trace missed (lost records, a reused pid).
            self.free_client(client, ts, FreedBy::Unseen);
            // pid 0: a snapshot's client whose maker was not known.
            self.clients.insert(client, Client::new(file, (pid != 0).then_some(pid)));
        } else {
            let gpu = gpu.or_else(|| self.gpu_of(client, parent));
            self.insert_object(client, pid, fd, ts, object, Object { parent, alloc: None, gpu, class });
        }
    }

    /// Whether `fd` of `pid` reaches `client`: RM acts on a client only through the file that
    /// made it (strict client validation, on unless a registry key turns it off:
    /// rmclientValidate), and a /dev/nvidiaN file registered with an nvidiactl file acts as that
    /// file (escape.c). A client first met now is taken on this call's word, and so is a record
    /// with no fd: the snapshot's own (a live call on fd -1 fails before any driver sees it).
    ///
    /// A registration made before tracing began (or whose record was lost) is inferred, within
    /// one process only: a device file of `pid` not known to be registered, and an nvidiactl file
    /// `pid` holds, one of them the client's and the other the call's, are taken to be registered
    /// together (REGISTER_FD takes only an nvidiactl fd of the caller's own). Pinned host memory
    /// (RM_ALLOC_MEMORY, only on a device file) of a process met after its registration is so
    /// followed, and nobody else's client is reached this way.
    pub(super) fn through_own_file(&mut self, pid: u32, fd: i32, client: u32) -> bool {
        if fd < 0 {
            return true;
        }
        let Some(owner) = self.clients.get(&client).and_then(|c| c.file) else { return true };
        let Some(file) = self.processes.get(&pid).and_then(|p| p.fds.get(&fd)).map(|f| f.file) else { return false };
        let (through, of) = (self.acting(file), self.acting(owner));
        if through == of {
            return true;
        }
        let holds = |f: FileId| self.processes.get(&pid).is_some_and(|p| p.fds.values().any(|r| r.file == f));
        let device_of = |f: FileId| self.files.get(&f).map(|f| f.device);
        let unregistered_device = |f: FileId| device_of(f) == Some(Device::Gpu) && !self.registered.contains_key(&f);
        let pair = [(file, of), (owner, through)]
            .into_iter()
            .find(|&(device, ctl)| unregistered_device(device) && device_of(ctl) == Some(Device::Ctl) && holds(device) && holds(ctl));
        match pair {
            Some((device, ctl)) => {
                self.register(device, ctl);
                // Clients made through the device file were RM's nvidiactl file's all along.
                for c in self.clients.values_mut().filter(|c| c.file == Some(device)) {
                    c.file = Some(ctl);
                }
                true
            }
            None => false,
        }
    }

    /// RM_SHARE: a handle (or the client itself, for all of its handles) shared beyond the
    /// process that made the client, or that no longer is (REVOKE). Any share that allows
    /// (ALL, a user's, a client, a GPU's) counts; one that only requires narrows nothing here.
    pub(super) fn on_share(&mut self, client: u32, object: u32, share_type: u16, action: u8) {
        const PID: u16 = 4;
        const REVOKE: u8 = 1;
        const REQUIRE: u8 = 2;
        let Some(c) = self.clients.get_mut(&client) else { return };
        if action & REVOKE != 0 {
            c.shared.remove(&(object, share_type));
        } else if action & REQUIRE == 0 && share_type != PID && share_type != 0 {
            c.shared.insert((object, share_type));
        }
    }

    /// Whether RM lets `taker` (the process of the destination client) dup `object` of `client`:
    /// the default share policy is the same process's (RS_SHARE_TYPE_PID, sharing.c; checked
    /// against ProcID, client_resource.c), anything else needs RM_SHARE (current libcuda's way;
    /// the NV0000 share controls are for branches before R450). Taken on the trace's word where
    /// the source client was made before tracing (its shares were not seen).
    pub(super) fn may_take(&self, taker: u32, (client, object): (u32, u32)) -> bool {
        let Some(c) = self.clients.get(&client) else { return true };
        let Some(owner) = c.pid else { return true };
        if owner == taker {
            return true;
        }
        // The object, its parents up the tree (bounded: a crafted trace may loop), the client.
        let shared = |h: u32| c.shares_of(h).next().is_some();
        let mut handle = object;
        for _ in 0..64 {
            if shared(handle) {
                return true;
            }
            match c.objects.get(&handle) {
                Some(o) if o.parent != handle => handle = o.parent,
                _ => break,
            }
        }
        shared(client)
    }

    /// The GPU of the object `handle` of `client`: the device it is, or is under.
    fn gpu_of(&self, client: u32, handle: u32) -> Option<u32> {
        self.clients.get(&client)?.objects.get(&handle)?.gpu
    }

    pub(super) fn on_dup_object(&mut self, pid: u32, ts: u64, fd: i32, (client, parent, object): (u32, u32, u32), src: (u32, u32)) {
        let source = self.clients.get(&src.0).and_then(|c| c.objects.get(&src.1));
        let (alloc, class) = source.map_or((None, UNKNOWN_CLASS), |o| (o.alloc, o.class));
        if let Some(id) = alloc {
            self.add_object_ref(id);
        }
        self.clear_handle(client, object, ts);
        let gpu = alloc.and_then(|id| self.allocations[id].gpu).or_else(|| self.gpu_of(client, parent));
        self.insert_object(client, pid, fd, ts, object, Object { parent, alloc, gpu, class });
    }

    /// EXPORT_OBJECT(S)_TO_FD: RM dups each object into a client of its own, kept by the
    /// nvidiactl file behind `to_fd` in a slot (`rmobjexportimport.c`): its memory outlives every
    /// RM_FREE of the caller's handles until that file's last close, in whichever process holds
    /// it then. The single form (`index` None) takes slot 0 of a file that holds no export and
    /// is refused on one that does (NV_ERR_STATE_IN_USE); a batch fills the slots from `index`
    /// on, replacing what they held, a 0 emptying its slot; the `more` handles past those the
    /// kernel side copied replace their slots with what is not followed.
    pub(super) fn on_export(&mut self, pid: u32, ts: u64, client: u32, objects: &[u32], (index, more): (Option<u16>, u32), to_fd: i32) {
        let Some(file) = self.file_of(pid, to_fd, ts) else { return };
        if index.is_none() && self.exports.contains_key(&file) {
            return;
        }
        let first = u32::from(index.unwrap_or(0));
        let end = first.saturating_add(u32::try_from(objects.len()).unwrap_or(u32::MAX)).saturating_add(more);
        let made: Vec<(u16, AllocId)> = (first..)
            .zip(objects)
            .filter_map(|(slot, &object)| {
                let id = self.alloc_of(client, object).filter(|_| object != 0)?;
                Some((u16::try_from(slot).ok()?, id))
            })
            .collect();
        let slots = self.exports.entry(file).or_default();
        let mut replaced = Vec::new();
        slots.retain(|&slot, id| {
            let refilled = (first..end).contains(&u32::from(slot));
            if refilled {
                replaced.push(*id);
            }
            !refilled
        });
        for (slot, id) in made {
            slots.insert(slot, id);
            *self.handle_refs.entry(id).or_default() += 1;
        }
        if slots.is_empty() {
            self.exports.remove(&file);
        }
        // RM frees what a slot held when the batch fills it again.
        for old in replaced {
            self.drop_handle(old, ts, FreedBy::Explicit);
        }
    }

    /// IMPORT_OBJECT(S)_FROM_FD: a new handle in the caller's client, under `parent`, to what
    /// each slot from `index` on of the file behind `from_fd` holds, as a dup is (0: none made).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_import(
        &mut self,
        pid: u32,
        ts: u64,
        fd: i32,
        (client, parent): (u32, u32),
        objects: &[u32],
        index: u16,
        from_fd: i32,
    ) {
        let file = self.file_of(pid, from_fd, ts);
        for (i, &object) in objects.iter().enumerate() {
            let Some(slot) = u16::try_from(i).ok().and_then(|i| index.checked_add(i)) else { break };
            if object == 0 {
                continue;
            }
            let alloc = file.and_then(|file| self.exports.get(&file)?.get(&slot).copied());
            if let Some(id) = alloc {
                self.add_object_ref(id);
            }
            self.clear_handle(client, object, ts);
            let class = alloc.map_or(UNKNOWN_CLASS, |id| self.allocations[id].class);
            let gpu = alloc.and_then(|id| self.allocations[id].gpu).or_else(|| self.gpu_of(client, parent));
            self.insert_object(client, pid, fd, ts, object, Object { parent, alloc, gpu, class });
        }
    }

    /// UVM_MAP_EXTERNAL_ALLOCATION: the mapping duplicates the RM memory object and keeps it
    /// until the range is destroyed (uvm_map_external.c), whatever RM_FREE does meanwhile.
    pub(super) fn on_uvm_map(&mut self, pid: u32, ts: u64, fd: i32, base: u64, (client, memory): (u32, u32)) {
        let Some(id) = self.alloc_of(client, memory) else { return };
        let Some(file) = self.file_of(pid, fd, ts) else { return };
        *self.handle_refs.entry(id).or_default() += 1;
        self.uvm_maps.entry((file, base)).or_default().push(id);
    }

    /// UVM_UNMAP_EXTERNAL (cuMemUnmap): the mappings in [base, base + length) go; the range stays.
    pub(super) fn on_uvm_unmap(&mut self, pid: u32, ts: u64, fd: i32, base: u64, length: u64) {
        if let Some(file) = self.file_of(pid, fd, ts) {
            self.unmap(ts, FreedBy::Unmapped, file, base, base.saturating_add(length.max(1)) - 1);
        }
    }

    /// UVM_FREE: destroys the range at `base` and every mapping in it.
    pub(super) fn on_uvm_free(&mut self, pid: u32, ts: u64, fd: i32, base: u64) {
        let Some(file) = self.file_of(pid, fd, ts) else { return };
        let range = self.uvm_ranges.remove(&(file, base));
        // A mapping lies in the range it was made in; with the range unknown (created before
        // tracing), the mappings at its base.
        let length = range.map_or(1, |id| self.allocations[id].bytes.max(1));
        self.unmap(ts, FreedBy::Unmapped, file, base, base.saturating_add(length) - 1);
        if let Some(id) = range {
            self.release(id, ts, FreedBy::Explicit);
        }
    }

    /// Drops the mappings of `file` based in [first, last], each releasing the memory (as `how`
    /// says) if it was its last reference.
    pub(super) fn unmap(&mut self, ts: u64, how: FreedBy, file: FileId, first: u64, last: u64) {
        let keys: Vec<(FileId, u64)> = self.uvm_maps.range((file, first)..=(file, last)).map(|(k, _)| *k).collect();
        for key in keys {
            for id in self.uvm_maps.remove(&key).unwrap_or_default() {
                self.drop_handle(id, ts, how);
            }
        }
    }

    /// A client created before tracing began is met first through one of its objects.
    fn client_mut(&mut self, client: u32, pid: u32, fd: i32, ts: u64) -> &mut Client {
        if !self.clients.contains_key(&client) {
            let file = self.file_of(pid, fd, ts).map(|f| self.acting(f));
            self.clients.insert(client, Client::new(file, None));
        }
        self.clients.get_mut(&client).expect("inserted above")
    }

    pub(super) fn alloc(&mut self, r: &Record, a: &Alloc) {
        let (ts, pid) = (r.ts, r.pid);
        if a.succeeded() && a.base.is_none() {
            self.clear_handle(a.client, a.object, ts);
        }
        let gpu = self.gpu_of(a.client, a.parent);
        if !a.succeeded() {
            self.process(pid, ts).usage.failed += 1;
            self.failures.push(FailedAllocation {
                ts,
                pid,
                memory: a.memory,
                bytes: a.bytes,
                via: a.via,
                status: a.status,
                errno: a.errno,
                gpu,
            });
            return;
        }
        let file = match a.base {
            Some(_) => self.file_of(pid, a.fd, ts),
            None => self.client_mut(a.client, pid, a.fd, ts).file,
        };
        let id = self.allocations.len();
        self.allocations.push(Allocation {
            ts,
            pid,
            tid: r.tid,
            memory: a.memory,
            bytes: a.bytes,
            via: a.via,
            client: a.client,
            object: a.object,
            class: a.class,
            file,
            gpu,
            freed: None,
            released: None,
        });
        self.process(pid, ts).usage.add(a.memory, a.bytes);
        self.handle_refs.insert(id, 1);
        // A sticky fabric object dups the memory it is made over until it goes itself. RM takes
        // only memory the fabric can map there (never another holder), so a trace that says
        // otherwise cannot make chains of holds.
        let held = a.holds.and_then(|h| self.alloc_of(a.client, h)).filter(|&h| self.fla_mappable(h) && !self.holds.contains_key(&h));
        if let Some(held) = held {
            *self.handle_refs.entry(held).or_default() += 1;
            self.holds.insert(id, held);
        }
        match (a.base, file) {
            (Some(base), Some(file)) => {
                if let Some(old) = self.uvm_ranges.insert((file, base), id) {
                    self.release(old, ts, FreedBy::Unseen);
                }
            }
            // An RM handle (a UVM range with no file only in a crafted trace lands here too).
            _ => {
                self.object_refs.insert(id, 1);
                let object = Object { parent: a.parent, alloc: Some(id), gpu, class: a.class };
                self.insert_object(a.client, pid, a.fd, ts, a.object, object);
            }
        }
    }

    /// A new handle in a client. Like a client handle, a live one is never handed out twice: what
    /// was there before (and below it) was freed unseen, and is released now.
    fn insert_object(&mut self, client: u32, pid: u32, fd: i32, ts: u64, handle: u32, object: Object) {
        self.clear_handle(client, handle, ts);
        self.client_mut(client, pid, fd, ts).insert(handle, object);
    }

    /// What a handle about to be made anew held before (and below it) was freed unseen: gone
    /// before anything of the new object (its GPU, through its parent) is read, as in RM, where
    /// the old object no longer exists when the new one is made.
    fn clear_handle(&mut self, client: u32, handle: u32, ts: u64) {
        if let Some(c) = self.clients.get_mut(&client) {
            for (_, o) in c.remove_subtree(handle) {
                if let Some(id) = o.alloc {
                    self.drop_object_ref(id, ts, FreedBy::Unseen);
                }
            }
        }
    }

    pub(super) fn free_handle(&mut self, client: u32, object: u32, ts: u64) {
        if client == object {
            self.free_client(client, ts, FreedBy::Explicit);
            return;
        }
        let Some(c) = self.clients.get_mut(&client) else { return };
        for (h, o) in c.remove_subtree(object) {
            if let Some(id) = o.alloc {
                self.drop_object_ref(id, ts, if h == object { FreedBy::Explicit } else { FreedBy::Subtree });
            }
        }
    }

    pub(super) fn free_client(&mut self, client: u32, ts: u64, how: FreedBy) {
        let Some(c) = self.clients.remove(&client) else { return };
        let how = if how == FreedBy::Explicit { FreedBy::Subtree } else { how };
        for o in c.objects.into_values() {
            if let Some(id) = o.alloc {
                self.drop_object_ref(id, ts, how);
            }
        }
    }

    /// A new RM handle to the memory of `id` (a dup, or an import of memory released since).
    fn add_object_ref(&mut self, id: AllocId) {
        *self.handle_refs.entry(id).or_default() += 1;
        *self.object_refs.entry(id).or_default() += 1;
        self.allocations[id].released = None;
    }

    /// An RM handle to `id` gone. The last one gone while something else (a UVM mapping, an
    /// export file, a fabric object) still holds the memory marks it released: the program let
    /// go of it, the driver has not yet.
    fn drop_object_ref(&mut self, id: AllocId, ts: u64, how: FreedBy) {
        let refs = self.object_refs.entry(id).or_insert(1);
        *refs = refs.saturating_sub(1);
        let last = *refs == 0;
        if last {
            self.object_refs.remove(&id);
        }
        self.drop_handle(id, ts, how);
        let a = &mut self.allocations[id];
        if last && a.is_live() {
            a.released = Some(ts);
        }
    }

    pub(super) fn drop_handle(&mut self, id: AllocId, ts: u64, how: FreedBy) {
        let refs = self.handle_refs.entry(id).or_insert(1);
        *refs = refs.saturating_sub(1);
        if *refs == 0 {
            self.handle_refs.remove(&id);
            self.release(id, ts, how);
        }
    }

    pub(super) fn release(&mut self, id: AllocId, ts: u64, how: FreedBy) {
        let a = &mut self.allocations[id];
        if a.freed.is_some() {
            return;
        }
        a.freed = Some((ts, how));
        let (pid, memory, bytes) = (a.pid, a.memory, a.bytes);
        if let Some(p) = self.processes.get_mut(&pid) {
            p.usage.remove(memory, bytes);
        }
        if let Some(held) = self.holds.remove(&id) {
            self.drop_handle(held, ts, how);
        }
        // A fabric object's destruction detaches everything attached to it.
        for held in self.attachments.remove(&id).into_iter().flat_map(BTreeMap::into_values) {
            self.drop_handle(held, ts, how);
        }
    }

    fn alloc_of(&self, client: u32, handle: u32) -> Option<AllocId> {
        self.clients.get(&client)?.objects.get(&handle)?.alloc
    }

    /// Whether RM lets a fabric object map (and so hold) this memory: video memory or EGM on the
    /// GPUs of drivers before 570 (`memmgrIsMemDescSupportedByFla_GA100`: ADDR_FBMEM or EGM).
    fn fla_mappable(&self, id: AllocId) -> bool {
        let a = &self.allocations[id];
        a.memory == Memory::Video || a.class == crate::abi::class::EXTENDED_USER
    }

    /// Where on a fabric object an attachment is (`attachments`): RM keeps a multicast object's
    /// attachments per GPU, whichever subdevice handle names it; the handle stands for itself
    /// when its GPU is not known (a device made before tracing), and 0 for a flexible object's.
    fn attach_point(&self, client: u32, subdevice: u32) -> u64 {
        match self.gpu_of(client, subdevice) {
            Some(gpu) => u64::from(gpu),
            None => HANDLE_POINT | u64::from(subdevice),
        }
    }

    /// ATTACH_MEM (drivers before 570): RM dups each memory attached to the fabric object and
    /// keeps the dup at its (GPU, offset) until DETACH_MEM there or the fabric object's
    /// end. Only video memory or EGM, on a fabric object (address space), at a free offset: RM
    /// refuses the rest, and a trace that says otherwise cannot make chains of holders.
    pub(super) fn on_fabric_attach<'a>(
        &mut self,
        (client, fabric): (u32, u32),
        subdevice: u32,
        done: impl Iterator<Item = &'a (u32, u64)>,
    ) {
        let is_fabric = |class| class == crate::abi::class::MEMORY_FABRIC || class == crate::abi::class::MULTICAST_FABRIC;
        let fabric_id = self.clients.get(&client).and_then(|c| c.objects.get(&fabric)).filter(|o| is_fabric(o.class)).and_then(|o| o.alloc);
        let Some(fabric_id) = fabric_id.filter(|&f| self.allocations[f].memory == Memory::Virtual) else { return };
        let at = self.attach_point(client, subdevice);
        for &(memory, offset) in done {
            let Some(held) = self.alloc_of(client, memory).filter(|&h| self.fla_mappable(h)) else { continue };
            let slots = self.attachments.entry(fabric_id).or_default();
            if slots.contains_key(&(at, offset)) {
                continue;
            }
            slots.insert((at, offset), held);
            *self.handle_refs.entry(held).or_default() += 1;
        }
    }

    /// DETACH_MEM: what was attached at each offset goes back (freed if nothing else holds it).
    pub(super) fn on_fabric_detach<'a>(
        &mut self,
        ts: u64,
        (client, fabric): (u32, u32),
        subdevice: u32,
        done: impl Iterator<Item = &'a u64>,
    ) {
        let Some(fabric_id) = self.alloc_of(client, fabric) else { return };
        let at = self.attach_point(client, subdevice);
        let Some(slots) = self.attachments.get_mut(&fabric_id) else { return };
        let released: Vec<AllocId> = done.filter_map(|&offset| slots.remove(&(at, offset))).collect();
        if slots.is_empty() {
            self.attachments.remove(&fabric_id);
        }
        for held in released {
            self.drop_handle(held, ts, FreedBy::Detached);
        }
    }
}
