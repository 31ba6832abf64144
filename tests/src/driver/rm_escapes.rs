//! The RM escapes: allocations by class, frees, dups, the controls that export, import and attach
//! memory, and what a file's release frees.

use super::*;

impl Driver {
    /// RM_ALLOC, NVOS21 or NVOS64: `p` is the struct, answered in place.
    fn rm_alloc(&mut self, caller: Caller, fh: u64, p: &mut [u8]) -> u32 {
        let status_at = if p.len() == 32 { self.abi.nvos21_status } else { self.abi.nvos64_status };
        let result = self.rm_alloc_inner(caller, fh, p);
        let status = result.err().unwrap_or(status::OK);
        put32(p, status_at, status);
        status
    }

    fn rm_alloc_inner(&mut self, caller: Caller, fh: u64, p: &mut [u8]) -> Result<(), u32> {
        let (root, parent, mut new, hclass, params) = (get32(p, 0), get32(p, 4), get32(p, 8), get32(p, 12), get64(p, 16));
        if matches!(hclass, 0 | 1 | class::ROOT_CLIENT) {
            if new == 0 {
                new = self.next_client;
                self.next_client += 1;
            }
            self.clients.insert(new, Client { file: fh, objects: HashMap::new() });
            put32(p, 8, new);
            return Ok(());
        }
        self.parent_ok(root, parent)?;
        if new == 0 {
            new = self.new_object_handle();
            put32(p, 8, new);
        }
        let size = self.class_params_size(hclass);
        let class_params = if size > 0 { read_mem(caller.tid, params, size).ok_or(status::INVALID_ARGUMENT)? } else { vec![] };
        // A device opens the GPU its deviceId names; an instance with no GPU is refused.
        let device = if hclass == class::DEVICE {
            let instance = get32(&class_params, 0) as usize;
            if instance >= self.gpus.len() {
                return Err(status::INVALID_ARGUMENT);
            }
            Some(instance)
        } else {
            None
        };
        // LOCAL_PHYSICAL (0xc2) and every class not memory: an object.
        let kind = match hclass {
            class::LOCAL_USER => Some(Kind::Video),
            class::SYSTEM | class::EXTENDED_USER => Some(Kind::System),
            class::NV50_MEMORY_VIRTUAL | class::MEMORY_FABRIC | class::MULTICAST_FABRIC => Some(Kind::Virtual),
            _ => None,
        };
        // A fabric object made over memory of this client, not FLEXIBLE, dups that memory.
        let held = if hclass == class::MEMORY_FABRIC && get32(&class_params, 24) & 1 == 0 && get32(&class_params, 40) != 0 {
            let object = self.clients.get(&root).and_then(|c| c.objects.get(&get32(&class_params, 40)));
            Some(object.and_then(|o| o.memory).ok_or(status::INVALID_OBJECT_HANDLE)?)
        } else {
            None
        };
        let size = match hclass {
            class::MEMORY_FABRIC => get64(&class_params, 8),
            class::MULTICAST_FABRIC => get64(&class_params, self.abi.multicast_params.1),
            _ => get64(&class_params, 64),
        };
        let gpu = self.gpu_under(root, parent);
        let memory = match kind {
            Some(kind) => Some(self.take(caller, (root, new, hclass), kind, gpu, size, "rm_alloc")?),
            None => None,
        };
        if let (Some(fabric), Some(held)) = (memory, held) {
            self.memory.get_mut(&held).expect("a live object's memory").handles += 1;
            self.memory.get_mut(&fabric).expect("just taken").holds = Some(held);
        }
        self.insert_object(root, new, parent, memory, device);
        Ok(())
    }

    fn rm_free(&mut self, caller: Caller, p: &mut [u8]) {
        let (root, old) = (get32(p, 0), get32(p, 8));
        if old == SLOW_FREE_HANDLE {
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
        if root == old {
            self.free_client(caller, root, "subtree");
        } else {
            self.free_subtree(caller, root, old);
        }
        // Freeing a handle that does not exist is NV_OK (RS_COMPATABILITY_MODE).
        put32(p, 12, status::OK);
    }

    fn vid_heap(&mut self, caller: Caller, p: &mut [u8]) {
        let (root, parent, function) = (get32(p, 0), get32(p, 4), get32(p, 8));
        let status = match function {
            2 => (|| {
                self.parent_ok(root, parent)?;
                let mut handle = get32(p, 44);
                if handle == 0 {
                    handle = self.new_object_handle();
                    put32(p, 44, handle);
                }
                let (flags, attr, size, attr2) = (get32(p, 52), get32(p, 56), get64(p, 88), get32(p, 144));
                let (kind, hclass) = if flags & 0x80000 != 0 {
                    (Kind::Virtual, class::NV50_MEMORY_VIRTUAL)
                } else if self.abi.vid_heap_egm && attr2 & (1 << 24) != 0 {
                    (Kind::System, class::EXTENDED_USER)
                } else if (attr >> 25) & 3 == 0 {
                    (Kind::Video, class::LOCAL_USER)
                } else {
                    (Kind::System, class::SYSTEM)
                };
                let gpu = self.gpu_under(root, parent);
                let id = self.take(caller, (root, handle, hclass), kind, gpu, size, "vid_heap_control")?;
                self.insert_object(root, handle, parent, Some(id), None);
                put64(p, 104, 0x2_0000_0000 + id * 0x1000_0000);
                Ok(())
            })(),
            3 => {
                self.free_subtree(caller, root, get32(p, 44));
                Ok(())
            }
            _ => Ok(()),
        };
        put32(p, 20, status.err().unwrap_or(status::OK));
    }

    fn alloc_memory(&mut self, caller: Caller, p: &mut [u8]) {
        let (root, parent, mut new, hclass, flags, limit) =
            (get32(p, 0), get32(p, 4), get32(p, 8), get32(p, 12), get32(p, 16), get64(p, 32));
        let status = (|| {
            self.parent_ok(root, parent)?;
            if new == 0 {
                new = self.new_object_handle();
                put32(p, 8, new);
            }
            // As rmapi_deprecated_allocmemory.c: system memory or pinned pages (in video memory
            // when the flags say so), address space; of LOCAL_USER only a mapping, no memory.
            let kind = match hclass {
                class::SYSTEM | class::OS_DESCRIPTOR if (flags >> 8) & 0xf == 2 => Kind::Video,
                class::SYSTEM | class::OS_DESCRIPTOR => Kind::System,
                class::MEMORY_VIRTUAL => Kind::Virtual,
                _ => {
                    self.insert_object(root, new, parent, None, None);
                    return Ok(());
                }
            };
            let gpu = self.gpu_under(root, parent);
            let id = self.take(caller, (root, new, hclass), kind, gpu, limit + 1, "rm_alloc_memory")?;
            self.insert_object(root, new, parent, Some(id), None);
            Ok(())
        })();
        put32(p, 40, status.err().unwrap_or(status::OK));
    }

    fn dup(&mut self, p: &mut [u8]) {
        let (client, parent, mut new, src_client, src_object) = (get32(p, 0), get32(p, 4), get32(p, 8), get32(p, 12), get32(p, 16));
        let status = (|| {
            self.parent_ok(client, parent)?;
            let memory = self
                .clients
                .get(&src_client)
                .ok_or(status::INVALID_CLIENT)?
                .objects
                .get(&src_object)
                .ok_or(status::INVALID_OBJECT_HANDLE)?
                .memory;
            if new == 0 {
                new = self.new_object_handle();
                put32(p, 8, new);
            }
            if let Some(id) = memory {
                self.memory.get_mut(&id).unwrap().handles += 1;
            }
            self.insert_object(client, new, parent, memory, None);
            Ok(())
        })();
        put32(p, 24, status.err().unwrap_or(status::OK));
    }

    /// One RM escape on its params; the reply to return, or an errno as the real driver gives.
    pub(super) fn rm_escape(&mut self, caller: Caller, fh: u64, inode: u64, nr: u32, p: &mut [u8]) -> Result<(), i32> {
        let on_ctl = inode == CTL_INODE;
        match (nr, p.len()) {
            (esc::RM_ALLOC, 32) | (esc::RM_ALLOC, 40) | (esc::RM_ALLOC, 48) if on_ctl => {
                if p.len() != 32 && p.len() != self.abi.nvos64_size {
                    return Err(EINVAL);
                }
                self.rm_alloc(caller, fh, p);
            }
            (esc::RM_FREE, 16) if on_ctl => self.rm_free(caller, p),
            (esc::RM_VID_HEAP_CONTROL, 184) if on_ctl => self.vid_heap(caller, p),
            (esc::RM_DUP_OBJECT, 28) if on_ctl => self.dup(p),
            (esc::RM_CONTROL, 32) if on_ctl => {
                let status = self.control(caller, fh, p).err().unwrap_or(status::OK);
                put32(p, 28, status);
            }
            (esc::RM_ALLOC_MEMORY, 56) if inode >= GPU_INODES => self.alloc_memory(caller, p),
            (esc::REGISTER_FD, 4) if inode >= GPU_INODES => self.register_fd(caller, fh),
            (esc::REGISTER_FD, 4) => {}
            (esc::CHECK_VERSION_STR, 72) => {
                put32(p, 4, 1);
                let v = self.version.as_bytes();
                p[8..72].fill(0);
                p[8..8 + v.len()].copy_from_slice(v);
            }
            _ => return Err(EINVAL),
        }
        Ok(())
    }

    /// RM_CONTROL: object export to a file and import from it; every other control succeeds and
    /// does nothing. FUSE does not say which open file a fd number in the params is, so the
    /// fake takes the export's file to be the caller's newest nvidiactl file other than the one
    /// the control came on (the workloads open it just before), and the import's to be the one
    /// file that holds an export; anything ambiguous is refused, never guessed.
    fn control(&mut self, caller: Caller, fh: u64, p: &[u8]) -> Result<(), u32> {
        const EXPORT: u32 = 0x3d05;
        const IMPORT: u32 = 0x3d06;
        const EXPORT_BATCH: u32 = 0x3d0b;
        const IMPORT_BATCH: u32 = 0x3d0c;
        const ATTACH: u32 = 0xf80103;
        const DETACH: u32 = 0xf80104;
        const MULTICAST_ATTACH: u32 = 0xfd0102;
        const MULTICAST_DETACH: u32 = 0xfd0105;
        let (client, cmd, ptr) = (get32(p, 0), get32(p, 8), get64(p, 16));
        let size = match cmd {
            EXPORT => 24,
            IMPORT => 20,
            EXPORT_BATCH => 2128,
            IMPORT_BATCH => 652,
            ATTACH => 2064,
            DETACH => 528,
            MULTICAST_ATTACH => 40,
            MULTICAST_DETACH => 24,
            _ => return Ok(()),
        };
        let mut params = read_mem(caller.tid, ptr, size).ok_or(status::INVALID_ARGUMENT)?;
        if cmd == ATTACH || cmd == DETACH {
            let result = self.fabric_control(caller, (client, get32(p, 4)), cmd == ATTACH, &mut params);
            return if write_mem(caller.tid, ptr, &params) { result } else { Err(status::INVALID_ARGUMENT) };
        }
        if cmd == MULTICAST_ATTACH || cmd == MULTICAST_DETACH {
            return self.multicast_control(caller, (client, get32(p, 4)), cmd == MULTICAST_ATTACH, &params);
        }
        let memory_of = |driver: &Driver, object: u32| -> Result<u64, u32> {
            let memory = driver.clients.get(&client).ok_or(status::INVALID_CLIENT)?.objects.get(&object);
            memory.ok_or(status::INVALID_OBJECT_HANDLE)?.memory.ok_or(status::INVALID_ARGUMENT)
        };
        if cmd == EXPORT || cmd == EXPORT_BATCH {
            // (slot, object) pairs: the single form's one object in slot 0, a batch's from its index.
            let pairs: Vec<(u16, u32)> = match cmd {
                EXPORT => vec![(0, get32(&params, 12))],
                _ => {
                    let (max, count, index) = (get16(&params, 8), get16(&params, 2124), get16(&params, 2126));
                    // A batch names at most 512 objects, inside the file's maxObjects slots.
                    if count > 512 || u32::from(index) + u32::from(count) > u32::from(max) {
                        return Err(status::INVALID_ARGUMENT);
                    }
                    (0..count).map(|i| (index.saturating_add(i), get32(&params, 76 + 4 * usize::from(i)))).collect()
                }
            };
            let ids = pairs.iter().map(|&(_, object)| if object == 0 { Ok(None) } else { memory_of(self, object).map(Some) });
            let ids: Vec<Option<u64>> = ids.collect::<Result<_, _>>()?;
            let tgid = self.tgid(caller.tid);
            let file = self.files.iter().filter(|(h, f)| **h != fh && f.inode == CTL_INODE && f.opener == tgid).map(|(h, _)| *h).max();
            let file = file.ok_or(status::INVALID_ARGUMENT)?;
            if cmd == EXPORT && !self.files[&file].exports.is_empty() {
                return Err(status::INVALID_ARGUMENT);
            }
            for ((slot, _), id) in pairs.into_iter().zip(ids) {
                let old = self.files.get_mut(&file).expect("found above").exports.remove(&slot);
                if let Some(id) = id {
                    self.memory.get_mut(&id).expect("a live object's memory").handles += 1;
                    self.files.get_mut(&file).expect("found above").exports.insert(slot, id);
                }
                if let Some(old) = old {
                    self.drop_handle(caller, old, "unexport");
                }
            }
            return Ok(());
        }
        let mut held = self.files.values().filter(|f| !f.exports.is_empty());
        let (Some(file), None) = (held.next(), held.next()) else { return Err(status::INVALID_ARGUMENT) };
        let slots = file.exports.clone();
        if cmd == IMPORT {
            let (parent, mut object) = (get32(&params, 12), get32(&params, 16));
            self.parent_ok(client, parent)?;
            let id = *slots.get(&0).ok_or(status::INVALID_ARGUMENT)?;
            if object == 0 {
                object = self.new_object_handle();
                put32(&mut params, 16, object);
                if !write_mem(caller.tid, ptr, &params) {
                    return Err(status::INVALID_ARGUMENT);
                }
            }
            self.memory.get_mut(&id).expect("an exported object's memory").handles += 1;
            self.insert_object(client, object, parent, Some(id), None);
            return Ok(());
        }
        // A batch: each nonzero handle becomes a dup of its slot, if that slot holds anything;
        // RM writes back each one's type (1, video memory) or 0 where nothing was imported.
        let parent = get32(&params, 4);
        self.parent_ok(client, parent)?;
        let (count, index) = (get16(&params, 648), get16(&params, 650));
        if count > 128 {
            return Err(status::INVALID_ARGUMENT);
        }
        for i in 0..usize::from(count) {
            let object = get32(&params, 8 + 4 * i);
            let id = slots.get(&index.saturating_add(i as u16)).copied().filter(|_| object != 0);
            params[520 + i] = u8::from(id.is_some());
            if let Some(id) = id {
                self.memory.get_mut(&id).expect("an exported object's memory").handles += 1;
                self.insert_object(client, object, parent, Some(id), None);
            }
        }
        if !write_mem(caller.tid, ptr, &params) {
            return Err(status::INVALID_ARGUMENT);
        }
        Ok(())
    }

    /// ATTACH_MEM / DETACH_MEM on a flexible fabric object (mem_fabric.c): up to 64 memInfos
    /// {hMemory@0, offset@8}, numMemInfos@2048, numAttached@2056 written back; or offsets[64],
    /// numOffsets@512, numDetached@520. Video memory of the same client, one per offset; before
    /// 570 each attachment is a dup of the memory.
    fn fabric_control(&mut self, caller: Caller, (client, fabric): (u32, u32), attach: bool, params: &mut [u8]) -> Result<(), u32> {
        let memory_of = |driver: &Driver, handle: u32| driver.clients.get(&client)?.objects.get(&handle)?.memory;
        let fabric = memory_of(self, fabric).filter(|id| self.memory[id].kind == Kind::Virtual).ok_or(status::INVALID_OBJECT_HANDLE)?;
        let (count_at, done_at) = if attach { (2048, 2056) } else { (512, 520) };
        let count = usize::from(get16(params, count_at));
        if count == 0 || count > 64 {
            return Err(status::INVALID_ARGUMENT);
        }
        let mut done = 0;
        let mut result = Ok(());
        for i in 0..count {
            let step = if attach {
                let (handle, offset) = (get32(params, 32 * i), get64(params, 32 * i + 8));
                match memory_of(self, handle).filter(|id| self.memory[id].kind == Kind::Video) {
                    Some(id) => self.attach_at(fabric, (0, offset), id),
                    None => Err(status::INVALID_ARGUMENT),
                }
            } else {
                self.detach_at(caller, fabric, (0, get64(params, 8 * i)))
            };
            if let Err(e) = step {
                result = Err(e);
                break;
            }
            done += 1;
        }
        put16(params, done_at, done);
        result
    }

    /// A multicast object's ATTACH_MEM (0xfd0102: hSubdevice@0, hMemory@4, offset@8) or
    /// DETACH_MEM (0xfd0105: hSubdevice@0, offset@8): one attachment at the subdevice's GPU.
    fn multicast_control(&mut self, caller: Caller, (client, multicast): (u32, u32), attach: bool, params: &[u8]) -> Result<(), u32> {
        let memory_of = |driver: &Driver, handle: u32| driver.clients.get(&client)?.objects.get(&handle)?.memory;
        let multicast =
            memory_of(self, multicast).filter(|id| self.memory[id].kind == Kind::Virtual).ok_or(status::INVALID_OBJECT_HANDLE)?;
        let subdevice = get32(params, 0);
        if !self.clients.get(&client).is_some_and(|c| c.objects.contains_key(&subdevice)) {
            return Err(status::INVALID_OBJECT_HANDLE);
        }
        let at = (self.gpu_under(client, subdevice), get64(params, 8));
        if attach {
            let memory =
                memory_of(self, get32(params, 4)).filter(|id| self.memory[id].kind == Kind::Video).ok_or(status::INVALID_ARGUMENT)?;
            self.attach_at(multicast, at, memory)
        } else {
            self.detach_at(caller, multicast, at)
        }
    }

    /// Memory attached to a fabric object at `at`: before 570 RM dups it there.
    fn attach_at(&mut self, fabric: u64, at: (usize, u64), memory: u64) -> Result<(), u32> {
        if self.memory[&fabric].attached.contains_key(&at) {
            return Err(status::INVALID_ARGUMENT);
        }
        if self.abi.major < 570 {
            self.memory.get_mut(&memory).expect("a live object's memory").handles += 1;
            self.memory.get_mut(&fabric).expect("a live fabric object").attached.insert(at, memory);
        }
        Ok(())
    }

    /// What was attached at `at` goes back; before 570 nothing there is an error.
    fn detach_at(&mut self, caller: Caller, fabric: u64, at: (usize, u64)) -> Result<(), u32> {
        match self.memory.get_mut(&fabric).expect("a live fabric object").attached.remove(&at) {
            Some(id) => {
                self.drop_handle(caller, id, "detached");
                Ok(())
            }
            None if self.abi.major < 570 => Err(status::INVALID_ARGUMENT),
            None => Ok(()),
        }
    }

    /// Every client created on the file `fh`, freed as its release does.
    pub(super) fn free_clients_of(&mut self, caller: Caller, fh: u64) {
        let mut clients: Vec<u32> = self.clients.iter().filter(|(_, c)| c.file == fh).map(|(h, _)| *h).collect();
        clients.sort();
        for client in clients {
            self.free_client(caller, client, "release");
        }
    }

    /// REGISTER_FD on a /dev/nvidiaN file: it holds an nvidiactl file until it goes (escape.c). FUSE
    /// does not say which file the caller's fd is: the caller's latest nvidiactl file stands for
    /// it, which is what libcuda (and the fake) registers.
    fn register_fd(&mut self, caller: Caller, fh: u64) {
        let tgid = self.tgid(caller.tid);
        let ctl = self.files.iter().filter(|(_, f)| f.inode == CTL_INODE && f.opener == tgid).map(|(h, _)| *h).max();
        if let (Some(ctl), Some(file)) = (ctl, self.files.get_mut(&fh)) {
            file.registered_ctl = Some(ctl);
        }
    }
}
